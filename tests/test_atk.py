"""ATK / PDN preconditioner: chunked == token-by-token reference, gradients, decoding, squash,
argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import packed_cu_seqlens, rel_err
from precond_linattn.ops.atk import atk_precondition, atk_step

B, T, H, K, C = 2, 45, 3, 8, 16


def atk_inputs(rand, B, T, H, K, decay, dtype=jnp.float32):
    return dict(k=rand.unit(B, T, H, K, dtype=dtype),
                log_decay=rand.log_decay(decay, B, T, H, K, dtype),
                gain=rand.beta(B, T, H, dtype=dtype), center=(rand.normal(H) - 0.2).astype(dtype))


def token(inp, t):
    """The positional arguments of ``atk_step`` for token t, before the state."""
    return inp["k"][:, t], inp["log_decay"][:, t], inp["gain"][:, t], inp["center"]


def initial(rand, N, H, K):
    return jnp.asarray(rand.rng.uniform(0.05, 1.0, (N, H, K)), jnp.float32)


def run(impl, inp, chunk_size=C, **kw):
    return atk_precondition(**inp, impl=impl, chunk_size=chunk_size, output_final_state=True, **kw)


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_reference_follows_spec_equations(rand, decay):
    inp = atk_inputs(rand, B, 6, H, K, decay)
    A0 = initial(rand, B, H, K)
    k, g, gain, c = (np.asarray(inp[n], np.float64) for n in ("k", "log_decay", "gain", "center"))
    g = g if decay == "vector" else g[..., None]
    A, want = np.asarray(A0, np.float64), []
    for t in range(6):  # SPEC 3.2, written out in numpy float64
        A = np.exp(g[:, t]) * A + gain[:, t, :, None] * k[:, t] ** 2
        rho = np.log(A + 1e-6) - c[:, None]
        want.append(np.exp(-np.log(1.5) * rho / (1 + np.abs(rho))) * k[:, t])
    kw, A_T = run("reference", inp, initial_state=A0)
    assert rel_err(kw, np.stack(want, axis=1)) <= 1e-6 and rel_err(A_T, A) <= 1e-6


@pytest.mark.parametrize("decay", ["scalar", "vector"])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("chunk", [C, 64])
def test_chunked_matches_reference(rand, decay, with_initial, chunk):
    inp = atk_inputs(rand, B, T, H, K, decay)
    A0 = initial(rand, B, H, K) if with_initial else None
    kw_ref, A_ref = run("reference", inp, initial_state=A0)
    kw, A = run("chunked", inp, chunk_size=chunk, initial_state=A0)
    assert kw.dtype == jnp.float32 and A.shape == (B, H, K) and A.dtype == jnp.float32
    assert rel_err(kw, kw_ref) <= 1e-5
    assert rel_err(A, A_ref) <= 1e-5


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_packed_equals_documents(rand, decay):
    lengths = [7, 20, 33]
    inp = atk_inputs(rand, 1, sum(lengths), H, K, decay)
    A0 = initial(rand, len(lengths), H, K)
    cu = packed_cu_seqlens(lengths)
    kw_ref, A_ref = run("reference", inp, initial_state=A0, cu_seqlens=cu)
    kw, A = run("chunked", inp, initial_state=A0, cu_seqlens=cu)
    assert rel_err(kw, kw_ref) <= 1e-5 and rel_err(A, A_ref) <= 1e-5
    docs = []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc = {name: x if x.ndim == 1 else x[:, a:b] for name, x in inp.items()}
        docs.append(run("chunked", doc, initial_state=A0[i:i + 1]))
    assert rel_err(kw, jnp.concatenate([d[0] for d in docs], axis=1)) <= 1e-5
    assert rel_err(A, jnp.concatenate([d[1] for d in docs])) <= 1e-5


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_gradients_match_reference(rand, decay):
    inp = atk_inputs(rand, B, T, H, K, decay)
    A0 = initial(rand, B, H, K)
    ct_k, ct_A = rand.normal(B, T, H, K), rand.normal(B, H, K)
    names = ("k", "log_decay", "gain", "center")

    def loss(impl, args, A0):
        kw, A = run(impl, dict(zip(names, args)), initial_state=A0)
        return jnp.sum(kw * ct_k) + jnp.sum(A * ct_A)

    args = tuple(inp[n] for n in names)
    g_ref = jax.grad(lambda a, s: loss("reference", a, s), argnums=(0, 1))(args, A0)
    g = jax.grad(lambda a, s: loss("chunked", a, s), argnums=(0, 1))(args, A0)
    for name, x, x_ref in zip(names + ("initial_state",), (*g[0], g[1]), (*g_ref[0], g_ref[1])):
        assert rel_err(x, x_ref) <= 1e-5, name


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_bf16_inputs(rand, decay):
    inp = atk_inputs(rand, B, T, H, K, decay, dtype=jnp.bfloat16)
    kw_ref, A_ref = run("reference", inp)
    kw, A = run("chunked", inp)
    assert kw.dtype == jnp.bfloat16 and A.dtype == jnp.float32
    assert rel_err(kw, kw_ref) <= 1e-2  # bf16 output rounding; the math is fp32 on both sides
    assert rel_err(A, A_ref) <= 1e-5


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_step_scan_matches_reference(rand, decay):
    inp = atk_inputs(rand, B, 12, H, K, decay)
    A = A0 = initial(rand, B, H, K)
    outs = []
    for t in range(12):
        kw_t, A = atk_step(*token(inp, t), A)
        outs.append(kw_t)
    kw_ref, A_ref = run("reference", inp, initial_state=A0)
    assert rel_err(jnp.stack(outs, axis=1), kw_ref) <= 1e-6 and rel_err(A, A_ref) <= 1e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unit_squash_is_identity(rand, dtype):
    inp = atk_inputs(rand, B, T, H, K, "vector", dtype=dtype)
    for impl in ("reference", "chunked"):
        np.testing.assert_array_equal(run(impl, inp, x=1.0)[0], inp["k"])
    A = initial(rand, B, H, K)
    kw_t, _ = atk_step(*token(inp, 0), A, x=1.0)
    np.testing.assert_array_equal(kw_t, inp["k"][:, 0])


@pytest.mark.parametrize("x", [1.5, 4.0])
def test_scale_stays_in_squash_range(rand, x):
    inp = atk_inputs(rand, B, T, H, K, "scalar")
    # tiny keys, then huge ones, drive log(A + eps) far to both sides, so σ nears −1 and +1
    inp["k"] = rand.normal(B, T, H, K) * jnp.where(jnp.arange(T) < T // 2, 1e-4, 1e3)[:, None, None]
    ratio = np.asarray(run("chunked", inp, x=x)[0], np.float64) / np.asarray(inp["k"], np.float64)
    ulp = 4 * np.finfo(np.float32).eps
    assert ratio.min() >= (1 - ulp) / x and ratio.max() <= (1 + ulp) * x
    assert ratio.min() < x ** -0.8 and ratio.max() > x ** 0.8


def _bad_calls():
    """(name, change to valid arguments, message pattern); valid: B=2, T=5, H=3, K=8."""
    one = lambda a: {n: x if x.ndim == 1 else x[:1] for n, x in a.items()}  # noqa: E731
    return [
        ("k rank", lambda a: {**a, "k": a["k"][0]}, r"^k must have shape"),
        ("k dtype", lambda a: {**a, "k": a["k"].astype(jnp.int32)}, r"^k has unsupported dtype"),
        ("log_decay shape", lambda a: {**a, "log_decay": a["log_decay"][..., :2]}, r"^log_decay"),
        ("log_decay rank", lambda a: {**a, "log_decay": a["log_decay"][0]}, r"^log_decay"),
        ("gain shape", lambda a: {**a, "gain": a["gain"][..., None]}, r"^gain must have shape"),
        ("gain dtype", lambda a: {**a, "gain": a["gain"] > 0.5}, r"^gain has unsupported dtype"),
        ("center shape", lambda a: {**a, "center": a["center"][:2]}, r"^center must have shape"),
        ("center rank", lambda a: {**a, "center": a["center"][None]}, r"^center must have shape"),
        ("x < 1", lambda a: {**a, "x": 0.9}, r"^x must be >= 1"),
        ("eps = 0", lambda a: {**a, "eps": 0.0}, r"^eps must be > 0"),
        ("eps < 0", lambda a: {**a, "eps": -1e-6}, r"^eps must be > 0"),
        ("eps nan", lambda a: {**a, "eps": float("nan")}, r"^eps must be a finite"),
        ("initial N", lambda a: {**a, "initial_state": jnp.ones((3, 3, 8))}, r"^initial_state"),
        ("initial rank", lambda a: {**a, "initial_state": jnp.ones((2, 3, 8, 1))},
         r"^initial_state"),
        ("cu_seqlens B", lambda a: {**a, "cu_seqlens": jnp.array([0, 5])}, r"^cu_seqlens"),
        ("cu_seqlens end", lambda a: {**one(a), "cu_seqlens": jnp.array([0, 4])},
         r"^cu_seqlens must end"),
        ("cu_seqlens order", lambda a: {**one(a), "cu_seqlens": jnp.array([0, 3, 3, 5])},
         r"^cu_seqlens must be strictly"),
        ("cu_seqlens dtype", lambda a: {**one(a), "cu_seqlens": jnp.array([0.0, 5.0])},
         r"^cu_seqlens must have an integer"),
        ("impl", lambda a: {**a, "impl": "fast"}, r"^impl must be one of"),
        ("chunk_size", lambda a: {**a, "chunk_size": 0}, r"^chunk_size must be a positive"),
    ]


@pytest.mark.parametrize("name, change, match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_arguments(rand, name, change, match):
    valid = atk_inputs(rand, 2, 5, 3, 8, "vector")
    atk_precondition(**valid)
    with pytest.raises(ValueError, match=match):
        atk_precondition(**change(valid))


@pytest.mark.parametrize("name, value, match", [
    ("k", jnp.ones((2, 1, 3, 8)), r"^k must have shape"),
    ("log_decay", jnp.ones((2,)), r"^log_decay must be None, \[B, H\] or \[B, H, K\]"),
    ("gain", jnp.ones((2, 3, 1)), r"^gain must have shape"),
    ("center", jnp.ones((4,)), r"^center must have shape"),
    ("A", jnp.ones((2, 3)), r"^A must have shape"),
    ("A", jnp.ones((2, 3, 7)), r"^A must have shape"),
    ("x", 0.5, r"^x must be >= 1"),
    ("eps", 0.0, r"^eps must be > 0"),
])
def test_step_bad_arguments(rand, name, value, match):
    valid = dict(k=rand.unit(2, 3, 8), log_decay=-rand.beta(2, 3), gain=rand.beta(2, 3),
                 center=rand.normal(3), A=initial(rand, 2, 3, 8))
    atk_step(**valid)
    with pytest.raises(ValueError, match=match):
        atk_step(**{**valid, name: value})
