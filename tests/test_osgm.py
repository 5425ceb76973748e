"""OSGM / OSDN preconditioner: chunked == token-by-token reference (values, final states,
gradients, fast path vs fallback), the decoding step, the SPEC 4 facts, and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import packed_cu_seqlens, rel_err
from precond_linattn.chunked.osgm import fast_path_chunks
from precond_linattn.ops.osgm import osgm_precondition, osgm_step
from precond_linattn.reference.delta import delta_step

B, T, H, K, C = 2, 75, 2, 8, 16  # T is not a multiple of C
STATIC = ("eta", "d_min", "d_max", "beta_aware", "eps", "output_final_state", "impl", "chunk_size")
op = jax.jit(osgm_precondition, static_argnames=STATIC)


def run(impl, k, beta, **kw):
    kw = {"chunk_size": C, **kw}
    return op(k, beta, impl=impl, output_final_state=True, **kw)


fast_path = jax.jit(fast_path_chunks, static_argnums=(3, 4, 5, 6, 7, 10))


def fast_chunks(k, beta, retention=None, *, eta, beta_aware=True, initial_state=None,
                cu_seqlens=None, chunk_size=C):
    """[NC] bool: which chunks took the active-set fast path (the others fell back)."""
    return np.asarray(fast_path(k, beta, retention, eta, 0.5, 2.0, beta_aware, 1e-6,
                                initial_state, cu_seqlens, chunk_size))


def retention(rand, *shape, low=0.9):
    return jnp.asarray(rand.rng.uniform(low, 1.0, shape), jnp.float32)


def inside_initial(rand, *shape):
    return jnp.asarray(rand.rng.uniform(0.6, 1.8, shape), jnp.float32)


def mixed_initial(rand, *shape):
    """Initial d with entries inside the box, on each bound and outside it."""
    d = rand.rng.uniform(0.3, 2.5, shape)
    d[..., 0], d[..., 1] = 2.0, 0.5
    return jnp.asarray(d, jnp.float32)


def pinning_problem(rand, B_, T_, start_high):
    """Skewed keys, small β and retention < 1: coordinates 0-2 (most of the key energy) climb to
    d_max (or start there) and stay pinned, 5-7 (almost none) start at d_min and stay pinned,
    3-4 stay free."""
    energy = np.array([1, 1, 1, 0.1, 0.1, 0.02, 0.02, 0.02])
    x = np.sign(rand.rng.standard_normal((B_, T_, H, K))) * energy
    x = x * (1 + 0.1 * rand.rng.standard_normal((B_, T_, H, K)))
    k = jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), jnp.float32)
    beta = jnp.asarray(rand.rng.uniform(0.1, 0.4, (B_, T_, H)), jnp.float32)
    init = [2.0 if start_high else 1.0] * 3 + [1.0] * 2 + [0.5] * 3
    return dict(k=k, beta=beta, retention=retention(rand, B_, T_, H, low=0.998) * 0.9995,
                initial_state=jnp.asarray(np.broadcast_to(init, (B_, H, K)), jnp.float32), eta=2.0)


@pytest.mark.parametrize("beta_aware", [True, False])
@pytest.mark.parametrize("with_retention", [False, True])
@pytest.mark.parametrize("initial", ["inside", "mixed"])
def test_chunked_matches_reference(rand, beta_aware, with_retention, initial):
    k, beta = rand.unit(B, T, H, K), rand.beta(B, T, H)
    d1 = inside_initial(rand, B, H, K) if initial == "inside" else mixed_initial(rand, B, H, K)
    kw = dict(eta=0.05, beta_aware=beta_aware, initial_state=d1,
              retention=retention(rand, B, T, H, low=0.99) if with_retention else None)
    kw_ref, d_ref = run("reference", k, beta, **kw)
    kw_ch, d_ch = run("chunked", k, beta, **kw)
    assert kw_ch.shape == (B, T, H, K) and d_ch.shape == (B, H, K) and d_ch.dtype == jnp.float32
    assert rel_err(kw_ch, kw_ref) <= 1e-5 and rel_err(d_ch, d_ref) <= 1e-5
    if initial == "inside":  # the fast path ran (with the mixed start, chunks may all fall back)
        assert fast_chunks(k, beta, kw.pop("retention"), **kw).any()


def test_packed_documents_match_one_by_one(rand):
    lengths = [20, 37, 5, 16]
    k, beta = rand.unit(1, sum(lengths), H, K), rand.beta(1, sum(lengths), H)
    r, init = retention(rand, 1, sum(lengths), H), mixed_initial(rand, len(lengths), H, K)
    kw = dict(eta=0.05, retention=r, initial_state=init)
    kw_ch, d_ch = run("chunked", k, beta, cu_seqlens=packed_cu_seqlens(lengths), **kw)
    kw_ref, d_ref = run("reference", k, beta, cu_seqlens=packed_cu_seqlens(lengths), **kw)
    assert rel_err(kw_ch, kw_ref) <= 1e-5 and rel_err(d_ch, d_ref) <= 1e-5
    start = 0
    for n, L in enumerate(lengths):
        part = slice(start, start + L)
        kw_one, d_one = run("reference", k[:, part], beta[:, part], eta=0.05, retention=r[:, part],
                            initial_state=init[n:n + 1])
        assert rel_err(kw_ch[:, part], kw_one) <= 1e-5 and rel_err(d_ch[n:n + 1], d_one) <= 1e-5
        start += L


def test_clip_active_pinned_coordinates(rand):
    p = pinning_problem(rand, B, 300, start_high=False)
    args = (p.pop("k"), p.pop("beta"))
    kw_ref, d_ref = run("reference", *args, chunk_size=32, **p)
    kw_ch, d_ch = run("chunked", *args, chunk_size=32, **p)
    assert rel_err(kw_ch, kw_ref) <= 1e-5 and rel_err(d_ch, d_ref) <= 1e-5
    d = np.asarray(kw_ref / args[0])  # d_t of every token, to rounding (no key coordinate is 0)
    on_bound = [np.mean(np.abs(d - bound) <= 1e-6) for bound in (2.0, 0.5)]
    assert min(on_bound) > 0.3  # the clip acts on most tokens, at both bounds
    fast = fast_chunks(*args, chunk_size=32, **p)
    assert not fast[0] and fast[1:].all()  # d climbs to d_max in chunk 0, then stays pinned


def test_fast_path_everywhere(rand):
    k, beta = rand.unit(B, 200, H, K), rand.beta(B, 200, H)
    r = retention(rand, B, 200, H, low=0.999)
    kw_ref, d_ref = run("reference", k, beta, retention=r)
    kw_ch, d_ch = run("auto", k, beta, retention=r)  # auto is the chunked form on CPU
    assert rel_err(kw_ch, kw_ref) <= 1e-5 and rel_err(d_ch, d_ref) <= 1e-5
    assert fast_chunks(k, beta, r, eta=0.003).all()


def outputs_and_grads(impl, inputs, cotangents, **kw):
    """(k̃, d_T) and the gradient of ⟨k̃, ct_0⟩ + ⟨d_T, ct_1⟩ w.r.t. every input."""
    def f(x):
        return osgm_precondition(x["k"], x["beta"], retention=x["retention"],
                                 initial_state=x["initial_state"], impl=impl,
                                 output_final_state=True, **kw)

    def run_vjp(x, cts):
        out, vjp = jax.vjp(f, x)
        return out, vjp(cts)[0]

    return jax.jit(run_vjp)(inputs, cotangents)


@pytest.mark.parametrize("case", ["mixed", "pinning", "free"])
def test_gradients_match_reference(rand, case):
    """mixed: initial d inside, on and outside the box, r ∈ [0.9, 1] (the fallback mostly runs);
    pinning: initial d on both bounds, pinned and free coordinates, all on the fast path;
    free: beta-free, all on the fast path."""
    if case == "pinning":
        x = pinning_problem(rand, B, 96, start_high=True)
        kw = dict(eta=x.pop("eta"), chunk_size=32)
    else:
        kw = dict(eta=0.05, beta_aware=case == "mixed", chunk_size=C)
        initial = mixed_initial if case == "mixed" else inside_initial
        x = dict(k=rand.unit(B, T, H, K), beta=rand.beta(B, T, H),
                 retention=retention(rand, B, T, H, low=0.9 if case == "mixed" else 0.999),
                 initial_state=initial(rand, B, H, K))
    fast = fast_chunks(**x, **kw)
    assert not fast.all() if case == "mixed" else fast.all()
    cts = (rand.normal(*x["k"].shape), rand.normal(B, H, K))
    (out_ref, g_ref), (out_ch, g_ch) = (outputs_and_grads(impl, x, cts, **kw)
                                        for impl in ("reference", "chunked"))
    assert rel_err(out_ch[0], out_ref[0]) <= 1e-5 and rel_err(out_ch[1], out_ref[1]) <= 1e-5
    for name in x:
        assert rel_err(g_ch[name], g_ref[name]) <= 1e-5, name


def test_unstable_solve_falls_back_with_finite_gradients(rand):
    """Large keys and η: c‖s‖² > 1 + r, where the in-chunk solve would overflow; the fallback runs
    and no inf/NaN from the unused fast path leaks into the gradients."""
    x = dict(k=3.0 * rand.normal(B, 40, H, K), beta=rand.beta(B, 40, H),
             retention=retention(rand, B, 40, H), initial_state=rand.unit(B, H, K) + 1.0)
    kw = dict(eta=50.0, chunk_size=32)
    assert not fast_chunks(**x, **kw).any()
    cts = (rand.normal(B, 40, H, K), rand.normal(B, H, K))
    (_, g_ref), (_, g_ch) = (outputs_and_grads(impl, x, cts, **kw)
                             for impl in ("reference", "chunked"))
    for name in x:
        assert np.isfinite(g_ch[name]).all() and rel_err(g_ch[name], g_ref[name]) <= 1e-5, name


def test_bf16_inputs(rand):
    k, beta = rand.unit(B, T, H, K, dtype=jnp.bfloat16), rand.beta(B, T, H, dtype=jnp.bfloat16)
    r = retention(rand, B, T, H, low=0.99).astype(jnp.bfloat16)
    kw_ref, d_ref = run("reference", k, beta, eta=0.05, retention=r)
    kw_ch, d_ch = run("chunked", k, beta, eta=0.05, retention=r)
    assert kw_ch.dtype == jnp.bfloat16 and d_ch.dtype == jnp.float32
    assert rel_err(kw_ch, kw_ref) <= 1e-2  # bf16 output rounding; the math is fp32 on both sides
    assert rel_err(d_ch, d_ref) <= 1e-5


@pytest.mark.parametrize("beta_aware", [True, False])
def test_step_scanned_matches_reference(rand, beta_aware):
    k, beta, r = rand.unit(B, T, H, K), rand.beta(B, T, H), retention(rand, B, T, H)
    d1 = mixed_initial(rand, B, H, K)
    hyper = dict(eta=0.05, d_min=0.5, d_max=2.0, beta_aware=beta_aware)

    @jax.jit
    def decode(k, beta, r, d):
        def step(d, x):
            k_write, d = osgm_step(*x[:2], d, retention=x[2], **hyper)
            return d, k_write

        tokens = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), (k, beta, r))
        d, k_write = jax.lax.scan(step, d, tokens)
        return jnp.swapaxes(k_write, 0, 1), d

    kw_dec, d_dec = decode(k, beta, r, d1)
    kw_ref, d_ref = run("reference", k, beta, retention=r, initial_state=d1, **hyper)
    assert rel_err(kw_dec, kw_ref) <= 1e-6 and rel_err(d_dec, d_ref) <= 1e-6


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_eta_zero_gives_k_exactly(rand, impl, dtype):
    k, beta = rand.unit(B, T, H, K, dtype=dtype), rand.beta(B, T, H, dtype=dtype)
    k_write, _ = run(impl, k, beta, eta=0.0)
    assert k_write.dtype == dtype and np.array_equal(np.asarray(k_write), np.asarray(k))


@pytest.mark.parametrize("decay", [None, "scalar"])
def test_surrogate_is_the_measured_normalised_loss_change(rand, decay):
    """h(d) = (f(S_t) − f(S_{t−1})) / ‖∇f(S_{t−1})‖² with f(S) = ½‖S̄ᵀk − v‖² and the write
    S_t = S̄ + β (d ⊙ k) uᵀ equals ((1 − β⟨d, s⟩)² − 1) / (2n), and so does its gradient in d;
    the beta-aware step is −η ∇h (no retention, clip inactive)."""
    V = 5
    S, k, v = rand.normal(B, H, K, V), 1.7 * rand.unit(B, H, K), rand.normal(B, H, V)
    beta, d = rand.beta(B, H), jnp.asarray(rand.rng.uniform(0.6, 1.9, (B, H, K)), jnp.float32)
    g = None if decay is None else -jnp.asarray(rand.rng.uniform(0.01, 1.0, (B, H)), jnp.float32)
    s, n = k * k, jnp.sum(k * k, axis=-1)

    def measured(d):  # per row: [B, H]
        S_t, _, _, S_bar = delta_step(S, k, k, d * k, v, beta, g, 1.0)
        f = lambda X: 0.5 * jnp.sum((jnp.einsum("bhkv,bhk->bhv", X, k) - v) ** 2, axis=-1)
        grad_f = jax.grad(lambda X: jnp.sum(f(X)))(S_bar)
        return (f(S_t) - f(S_bar)) / jnp.sum(grad_f ** 2, axis=(-2, -1))

    closed = ((1 - beta * jnp.sum(d * s, -1)) ** 2 - 1) / (2 * n)
    closed_grad = -(beta / n * (1 - beta * jnp.sum(d * s, -1)))[..., None] * s
    assert rel_err(measured(d), closed) <= 1e-5
    assert rel_err(jax.grad(lambda d: jnp.sum(measured(d)))(d), closed_grad) <= 1e-5
    _, d_next = osgm_step(k, beta, d, eta=0.05, d_min=0.5, d_max=2.0)
    assert rel_err((d_next - d) / 0.05, -closed_grad) <= 1e-4  # d_next − d carries ulp(d) / η


def test_one_step_contraction(rand):
    """OSDN, no decay, unit keys: f_t(S_t) = (1 − a_t)² f_t(S_{t−1}) with a_t = β_t⟨d_t, s_t⟩
    in (0, 2), so every write with a non-zero residual lowers f_t."""
    V = 4
    k, v, beta = rand.unit(B, T, H, K), rand.normal(B, T, H, V), rand.beta(B, T, H)
    k_write, _ = run("chunked", k, beta, eta=0.05)
    a = beta * jnp.sum(k_write * k, axis=-1)

    def step(S, x):
        k_t, kw_t, v_t, b_t = x
        S_t, _, u, _ = delta_step(S, k_t, k_t, kw_t, v_t, b_t, None, 1.0)
        after = jnp.einsum("bhkv,bhk->bhv", S_t, k_t) - v_t
        return S_t, (0.5 * jnp.sum(u ** 2, -1), 0.5 * jnp.sum(after ** 2, -1))

    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (k, k_write, v, beta))
    scan = jax.jit(lambda S, xs: jax.lax.scan(step, S, xs))
    _, (before, after) = scan(rand.normal(B, H, K, V), xs)
    before, after = jnp.swapaxes(before, 0, 1), jnp.swapaxes(after, 0, 1)
    assert np.all((a > 0) & (a < 2)) and np.all(after < before)
    assert rel_err(after, (1 - a) ** 2 * before) <= 1e-5


def test_traced_hyper_parameters(rand):
    """η and the box may be traced (e.g. swept under jit); the value checks then skip."""
    k, beta = rand.unit(B, T, H, K), rand.beta(B, T, H)
    traced = jax.jit(lambda k, beta, eta, lo, hi: osgm_precondition(
        k, beta, eta=eta, d_min=lo, d_max=hi, impl="chunked", chunk_size=C)[0])
    static = run("chunked", k, beta, eta=0.05, d_min=0.8, d_max=1.2)[0]
    assert rel_err(traced(k, beta, 0.05, 0.8, 1.2), static) <= 1e-6


@pytest.fixture
def inputs(rand):
    return rand.unit(1, 12, H, K), rand.beta(1, 12, H)


@pytest.mark.parametrize("kw, match", [
    (dict(k=lambda k: k[0]), r"k must have shape \[B, T, H, K\]"),
    (dict(k=lambda k: k.tolist()), r"k must be an array of shape \[B, T, H, K\]"),
    (dict(k=lambda k: k.astype(jnp.int32)), "k has unsupported dtype int32"),
    (dict(beta=lambda b: b[..., None]), r"beta must have shape \[B, T, H\]"),
    (dict(beta=lambda b: b[:, :5]), r"beta must have shape \[B, T, H\]"),
    (dict(retention=lambda b: b[:, :5]), r"retention must have shape \[B, T, H\]"),
    (dict(initial_state=jnp.ones((2, H, K))), r"initial_state must have shape \[N, H, K\]"),
    (dict(initial_state=jnp.ones((1, H))), r"initial_state must have shape \[N, H, K\]"),
    (dict(cu_seqlens=jnp.array([0, 5, 11])), "cu_seqlens must end at T=12"),
    (dict(cu_seqlens=jnp.array([0.0, 12.0])), "cu_seqlens must have an integer dtype"),
    (dict(cu_seqlens=jnp.array([0, 7, 7, 12])), "cu_seqlens must be strictly increasing"),
    (dict(eta=-0.1), "eta must be >= 0"),
    (dict(d_min=0.0), "d_min must be > 0"),
    (dict(d_min=1.5, d_max=1.0), r"^d_max must be >= d_min, got the empty box .* = \[1.5, 1.0\]"),
    (dict(d_max=float("inf")), "d_max must be a finite scalar"),
    (dict(eps=0.0), "eps must be > 0"),
    (dict(beta_aware=1), "beta_aware must be a bool"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(chunk_size=0), "chunk_size must be a positive int"),
])
def test_bad_arguments(inputs, kw, match):
    k, beta = inputs
    kw = dict(kw)
    k = kw.pop("k", lambda x: x)(k)
    beta_arg = kw.pop("beta", lambda x: x)(beta)
    if "retention" in kw:
        kw["retention"] = kw["retention"](beta)
    with pytest.raises(ValueError, match=match):
        osgm_precondition(k, beta_arg, **kw)


def test_cu_seqlens_needs_batch_one(rand):
    with pytest.raises(ValueError, match="cu_seqlens requires batch size 1"):
        osgm_precondition(rand.unit(2, 12, H, K), rand.beta(2, 12, H),
                          cu_seqlens=jnp.array([0, 12]))


@pytest.mark.parametrize("kw, match", [
    (dict(k=lambda a: a[0]), r"k must have shape \[B, H, K\]"),
    (dict(beta=lambda a: a[:, :1]), r"beta must have shape \[B, H\]"),
    (dict(d=lambda a: a[..., :3]), r"d must have shape \[B, H, K\]"),
    (dict(retention=lambda a: a[:, :1]), r"retention must have shape \[B, H\]"),
    (dict(eta=-1.0), "eta must be >= 0"),
    (dict(d_min=3.0), r"^d_max must be >= d_min, got the empty box .* = \[3.0, 2.0\]"),
    (dict(eps=-1.0), "eps must be > 0"),
])
def test_step_bad_arguments(rand, kw, match):
    kw = dict(kw)
    x = dict(k=rand.unit(B, H, K), beta=rand.beta(B, H), d=rand.unit(B, H, K) + 1.0,
             retention=rand.beta(B, H))
    for name in ("k", "beta", "d", "retention"):
        if name in kw:
            x[name] = kw.pop(name)(x[name])
    hyper = {"eta": 0.1, "d_min": 0.5, "d_max": 2.0, **kw}
    with pytest.raises(ValueError, match=match):
        osgm_step(x["k"], x["beta"], x["d"], retention=x["retention"], **hyper)
