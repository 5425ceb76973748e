"""The per-channel WY forward on the tensor cores (pallas_kernels/wy_vector_mosaic.py) in
interpret mode on CPU: its outputs against ``delta_rule.prepare_sums`` in float32 on both of its
paths, its CUDA lowering, and the op with ``vector_wy="mosaic"`` against the token-by-token
reference and the Triton WY kernels (packed documents, a tail chunk, K and V padded)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond_linattn as pla
from pallas_kernels import delta_rule as dr
from pallas_kernels import wy_vector_mosaic
from pallas_kernels.triton_common import Dots
from precond_linattn.chunked.delta import chunk_grams
from conftest import mosaic_kernels_lowered_for_cuda, packed_cu_seqlens, rel_err
from test_pallas_precision import assert_within_fla_bars, outputs_and_grads, rel_rms

B, NC, H, C = 1, 2, 3, 64
EXACT = Dots("ieee", interpret=True)


def log_decays(rand, B, T, K):
    """Per-channel log decays [B, T, 3, K], one head a path of the kernel: head 0 mild (-0.01
    .. -1 a token: every chunk whole), head 1 -2.5 .. -4 (32 rows spread > 72, 16 <= 64: the
    halves), head 2 -5 .. -9 (16 rows spread > 72: exact)."""
    heads = [-rand.rng.uniform(lo, hi, (B, T, 1, K)) for lo, hi in ((0.01, 1), (2.5, 4), (5, 9))]
    return jnp.asarray(np.concatenate(heads, axis=2), jnp.float32)


def kernel_inputs(rand, K, V):
    """q, k, k̃, v (bf16), β and γ (the in-chunk cumsum of ``log_decays``) in the kernel's
    layout [B, Tp, H, ·]."""
    T = NC * C
    x = rand.delta_inputs(B, T, H, K, V, dtype=jnp.bfloat16)
    g = log_decays(rand, B, T, K)
    gamma = jnp.cumsum(g.reshape(B, NC, C, H, K), axis=2).reshape(g.shape)
    return x["q"], x["k"], x["write_key"], x["v"], x["beta"].astype(jnp.float32), gamma


@pytest.mark.parametrize("K, V", [(64, 128), (128, 64)])
def test_matches_prepare_on_each_path(rand, K, V):
    """W, U, K̃', Q', P within one bf16 rounding of ``prepare_sums``' float32 values (plus 1e-4
    of their largest: W and U are sums that cancel), Γ_C exact to rounding, and T (I + L) = I
    to 1e-5 for ``chunk_grams``' L (to 1e-4 with two bf16 passes a merge product instead of
    three, further than three); head h's chunks take path h (whole, halves, exact)."""
    ins = kernel_inputs(rand, K, V)
    q, k, kw, v, beta, gamma = ins
    assert (wy_vector_mosaic.paths(gamma) == np.arange(H)).all()
    *got, T = jax.jit(functools.partial(wy_vector_mosaic.wy_vector_fwd, interpret=True))(*ins)
    cfg = dr._Config(C, "vector", 1.0, None, dr.Options(), EXACT, EXACT)
    g = gamma.reshape(B, NC, C, H, K)
    sigma = (g[:, :, -1:] - g).reshape(gamma.shape)
    want = dr.prepare_sums(cfg, q, k, kw, v, beta, gamma, sigma)
    for name, a, b in zip(("W", "U", "K̃'", "Q'", "P", "Γ_C"), got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.abs(a - b) <= 2.0 ** -8 * np.abs(b) + 1e-4 * np.abs(b).max()), name
    views = dr._views(cfg, q, k, kw, beta, gamma)
    L, _ = chunk_grams(*views)
    eye = jnp.eye(C)
    def residual(T):
        TL = jnp.einsum("bhncd,bhnde->bhnce", T.reshape(L.shape), L + eye, precision="highest")
        return rel_err(TL, jnp.broadcast_to(eye, L.shape))

    T2 = jax.jit(functools.partial(wy_vector_mosaic.wy_vector_fwd, interpret=True,
                                   passes=2))(*ins)[-1]
    assert residual(T) <= 1e-5 and residual(T) < residual(T2) <= 1e-4


@pytest.mark.parametrize("passes", [3, 2])
def test_lowers_for_cuda(passes):
    """Through Mosaic GPU's own passes (layout inference: the padded buffers' reads at 16 row
    offsets, the cond's two paths, the phases' shared buffers) at K = 128, V = 64, with three
    and two bf16 passes a merge product of the inverse."""
    s = jax.ShapeDtypeStruct
    tok = lambda d: s((B, NC * C, H, d), jnp.bfloat16)  # noqa: E731
    fn = lambda *a: wy_vector_mosaic.wy_vector_fwd(*a, interpret=False,  # noqa: E731
                                                   passes=passes)
    args = (tok(128), tok(128), tok(128), tok(64), s((B, NC * C, H), jnp.float32),
            s((B, NC * C, H, 128), jnp.float32))
    assert mosaic_kernels_lowered_for_cuda(fn, args) == 1


@pytest.mark.parametrize("pullback", ["kernel", "mosaic"])
def test_op_within_fla_bars_and_as_the_triton_kernels(rand, pullback):
    """``delta_rule_pallas`` with ``vector_wy="mosaic"`` and either pullback (Triton's or
    ``wy_vector_pullback_mosaic``; three packed documents over T = 150, a tail chunk, K = 40 and
    V = 48 padded to 64, initial states, each head's chunks on one of the forward's three paths):
    outputs, final states and every gradient within FLA's bars of the float32 reference, and
    within 1.1x of the errors with the Triton WY kernels (their WY tensors stored in bf16
    too)."""
    T, K, V = 150, 40, 48
    x = rand.delta_inputs(1, T, H, K, V, dtype=jnp.bfloat16)
    x = dict(q=x["q"], k=x["k"], write_key=x["write_key"], v=x["v"], beta=x["beta"],
             log_decay=log_decays(rand, 1, T, K), s0=rand.normal(3, H, K, V))
    cu = packed_cu_seqlens([50, 70, 30])

    def kernel(options, x):
        return dr.delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"],
                                    x["log_decay"], K ** -0.5, x["s0"], cu, 64, options)

    def reference(x):
        return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["write_key"],
                              log_decay=x["log_decay"], initial_state=x["s0"], cu_seqlens=cu,
                              output_final_state=True, impl="reference")

    fs = [functools.partial(kernel, dr.Options(vector_wy=w, wy_dtype="bfloat16",
                                               vector_pullback=p))
          for w, p in (("mosaic", pullback), ("kernel", "kernel"))]
    key = jax.random.key(1)
    mosaic, triton, ref = [jax.jit(functools.partial(outputs_and_grads, f))(x, key)
                           for f in fs + [reference]]
    assert_within_fla_bars(mosaic, ref)
    pairs = [(mosaic[0], triton[0], ref[0]), (mosaic[1], triton[1], ref[1])]
    pairs += [(mosaic[2][n], triton[2][n], ref[2][n]) for n in ref[2]]
    for got, base, want in pairs:
        assert rel_rms(got, want) <= 1.1 * rel_rms(base, want) + 1e-4


@pytest.mark.parametrize("change, message", [
    (dict(dtype=jnp.float32), "bfloat16 inputs"),
    (dict(chunk=32), "chunk_size 64"),
    (dict(K=32), "head dim K in \\(64, 128\\), got 32"),
    (dict(wy_dtype="float32"), "wy_dtype 'bfloat16'"),
])
def test_refuses_what_it_cannot_take(rand, change, message):
    """A clear ValueError naming what ``vector_wy="mosaic"`` needs."""
    K, dtype = change.get("K", 64), change.get("dtype", jnp.bfloat16)
    x = rand.delta_inputs(1, 64, 1, K, 64, decay="vector", dtype=dtype)
    options = dr.Options(vector_wy="mosaic", wy_dtype=change.get("wy_dtype"))
    with pytest.raises(ValueError, match=message):
        dr.delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"], x["log_decay"],
                             1.0, None, None, change.get("chunk", 64), options)


def test_kernel_refuses_rows_not_in_whole_chunks(rand):
    """Called directly (the op pads), rows of Tp = 100 tokens: a ValueError naming Tp."""
    q, k, kw, v, beta, gamma = (x[:, :100] for x in kernel_inputs(rand, 64, 64))
    with pytest.raises(ValueError, match="Tp must be a multiple of 64, got 100"):
        wy_vector_mosaic.wy_vector_fwd(q, k, kw, v, beta, gamma, interpret=True)


def test_default_options_reach_calls_that_name_none(rand, monkeypatch):
    """``delta_rule.default_options``: the public op (``impl="pallas"``, as the layers and
    models call it) runs the Triton WY forward outside and the Mosaic one inside
    ``default_options(Options(vector_wy="mosaic"))`` (a nested ``default_options(None)`` keeps
    the enclosing options), with ``Options.inverse_passes`` reaching it; anything but Options
    is refused naming the setter."""
    calls = []
    real = wy_vector_mosaic.wy_vector_fwd
    monkeypatch.setattr(wy_vector_mosaic, "wy_vector_fwd",
                        lambda *a, **kw: calls.append(kw["passes"]) or real(*a, **kw))
    x = rand.delta_inputs(1, 64, 1, 64, 64, decay="vector", dtype=jnp.bfloat16)

    def trace():  # a new function each time: eval_shape caches traces by the function
        jax.eval_shape(lambda: pla.delta_rule(x["q"], x["k"], x["v"], x["beta"],
                                              write_key=x["write_key"], log_decay=x["log_decay"],
                                              impl="pallas"))

    trace()
    assert not calls
    with dr.default_options(dr.Options(vector_wy="mosaic")), dr.default_options(None):
        trace()
    assert calls and set(calls) == {3}  # the inverse's passes: 3 unless named
    with dr.default_options(dr.Options(vector_wy="mosaic", inverse_passes=2)):
        trace()
    assert calls[-1] == 2
    with pytest.raises(ValueError, match="default_options"):
        with dr.default_options(dict(vector_wy="mosaic")):
            pass


@pytest.mark.parametrize("given, fits, expected", [
    (dict(), True, "mosaic"),
    (dict(), False, "kernel"),
    (dict(precision="tf32"), True, "kernel"),
    (dict(split=False), True, "kernel"),
    (dict(wy_dtype="float32"), True, "kernel"),
    (dict(wy_dtype="bfloat16"), True, "mosaic"),
    (dict(vector_wy="halving"), True, "halving"),
    (dict(vector_wy="mosaic"), False, "mosaic"),
    (dict(vector_pullback="mosaic"), True, "mosaic"),
    (dict(vector_pullback="kernel"), True, "mosaic"),
])
def test_resolve_picks_the_mosaic_forward_where_it_runs(given, fits, expected):
    """``vector_wy`` None resolves to "mosaic" for 16-bit inputs where the kernel runs, with
    ``precision`` left None, the split pipeline and bf16 WY tensors allowed; else "kernel"; a
    given value stays. ``vector_pullback`` None follows the forward ("mosaic" with Mosaic's)."""
    options = dr.resolve(dr.Options(**given), sixteen_bit=True, vector_mosaic_fits=fits)
    assert options.vector_wy == expected
    assert options.vector_pullback == given.get("vector_pullback",
                                                "mosaic" if expected == "mosaic" else "kernel")
    if given.get("vector_pullback") == "mosaic":  # the Mosaic pullback needs the Mosaic forward
        with pytest.raises(ValueError, match="vector_pullback='mosaic' needs the Mosaic WY "
                                             "forward \\(vector_wy='mosaic'\\), got "
                                             "vector_wy='kernel'"):
            dr.resolve(dr.Options(**given), sixteen_bit=False)
        return
    options = dr.resolve(dr.Options(**given), sixteen_bit=False)
    assert options.vector_wy == given.get("vector_wy", "kernel")
    assert options.vector_pullback == given.get(
        "vector_pullback", "mosaic" if options.vector_wy == "mosaic" else "kernel")


@pytest.mark.parametrize("change, runs", [
    (dict(), True), (dict(decay="scalar"), False), (dict(interpret=True), False),
    (dict(dtype=jnp.float32), False), (dict(K=32), False), (dict(chunk=32), False),
    (dict(hopper=False), False),
])
def test_vector_mosaic_runs_here(monkeypatch, change, runs):
    """Compiled on Hopper for a per-channel decay, bf16, chunk 64 and K, V in {64, 128} only."""
    args = dict(decay="vector", interpret=False, chunk=64, K=128, V=64, dtype=jnp.bfloat16)
    hopper = change.pop("hopper", True)
    monkeypatch.setattr(dr.state_mosaic, "hopper", lambda: hopper)
    assert dr.vector_mosaic_runs_here(**(args | change)) == runs


def test_op_takes_the_mosaic_forward_by_default_where_it_runs(rand, monkeypatch):
    """The public op with no options runs ``wy_vector_mosaic`` for bf16 KDA where
    ``vector_mosaic_runs_here`` says so (patched true: this CPU traces the interpret-mode
    kernel), and not for float32 inputs."""
    calls = []
    real = wy_vector_mosaic.wy_vector_fwd
    monkeypatch.setattr(wy_vector_mosaic, "wy_vector_fwd",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(dr, "vector_mosaic_runs_here", lambda **kw: kw["dtype"] == jnp.bfloat16)
    for dtype, expected in ((jnp.float32, []), (jnp.bfloat16, [1])):
        x = rand.delta_inputs(1, 64, 1, 64, 64, decay="vector", dtype=dtype)
        jax.eval_shape(lambda: pla.delta_rule(x["q"], x["k"], x["v"], x["beta"],  # noqa: B023
                                              write_key=x["write_key"], log_decay=x["log_decay"],
                                              impl="pallas"))
        assert calls == expected
