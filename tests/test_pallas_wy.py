"""The chunk-parallel WY kernels (pallas_kernels/wy_triton.py) against ``delta_rule.prepare``
and its ``jax.vjp`` pullback (interpret mode on CPU), in the kernels' layout after padding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import delta_rule as dr
from pallas_kernels.triton_common import Dots, unit_lower_inverse
from pallas_kernels.wy_triton import wy_bwd, wy_fwd, wy_inverse
from pallas_kernels.wy_vector_triton import wy_vector_bwd, wy_vector_fwd
from precond_linattn.chunked.delta import chunk_grams, decay_sums
from conftest import jitted_vjp, rel_err, triton_kernels_lowered_for_cuda

B, NC, H, K, V, C = 2, 3, 3, 16, 32, 16
DOTS = Dots("tf32x3", interpret=True)


def flat(g):
    """Log decays [B, NC, C, ...] in the kernels' layout [B, Tp, ...]."""
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def gamma_sigma(g):
    """(γ, σ) [B, Tp, ...] from log decays g [B, NC, C, ...] as the per-channel kernels see them:
    the in-chunk cumsum and σ = γ_C − γ as they form it (the op passes ``prepare`` σ as
    ``suffix_sums``, equal up to rounding; here both sides see the same values)."""
    gamma = jnp.cumsum(g, axis=2)
    return flat(gamma), flat(gamma[:, :, -1:] - gamma)


def inputs(rand, decay, dtype, k_dim=K):
    """q, k, kw [B, Tp, H, k_dim], v [B, Tp, H, V], beta and the log decays g [B, Tp, H]
    (float32; None without a decay)."""
    Tp = NC * C
    x = rand.delta_inputs(B, Tp, H, k_dim, V, decay="scalar" if decay == "scalar" else None,
                          dtype=dtype)
    g = None if decay != "scalar" else x["log_decay"].astype(jnp.float32)
    return x["q"], x["k"], x["write_key"], x["v"], x["beta"], g


def oracle(decay, ins, dtype=jnp.float32):
    """``prepare``'s outputs and ``jax.vjp`` pullback, the inputs cast to ``dtype`` (g stays
    float32)."""
    cfg = dr._Config(C, decay, 1.0, None, dr.Options(), DOTS, DOTS)
    cast = [None if x is None else x.astype(dtype) for x in ins[:5]] + list(ins[5:])
    return jitted_vjp(functools.partial(dr.prepare, cfg), *cast)


def kernels(ins, cts, block_v, block_k=64):
    """``wy_fwd``'s six WY tensors and ``wy_bwd``'s cotangents (given the forward's T, and P
    with a decay); checks
    that T is (I + L)^-1 for ``chunk_grams``' L."""
    opts = dict(chunk=C, block_v=block_v, block_k=block_k, dots=DOTS, num_warps=4, num_stages=1)
    *wy, T = jax.jit(functools.partial(wy_fwd, **opts))(*ins)
    views = dr._views(dr._Config(C, "none", 1.0, None, dr.Options(), DOTS, DOTS), *ins)
    gamma = None if views[5] is None else decay_sums(views[5], 3)[0]
    L, _ = chunk_grams(*views[:3], views[4], gamma)
    eye = jnp.eye(C)
    TL = jnp.einsum("bhncd,bhnde->bhnce", T.reshape(L.shape), L + eye, precision="highest")
    assert rel_err(TL, jnp.broadcast_to(eye, L.shape)) <= 1e-5
    P = None if ins[5] is None else wy[4]
    return wy, jax.jit(functools.partial(wy_bwd, **opts))(*ins, T, *cts, P=P)


def check(got, want, tol, names):
    """Each float32 result within ``tol`` of ``want`` (relative max error); a bf16 one (the
    cotangent of a bf16 input, stored in its dtype) is ``want`` rounded once: within one
    rounding (2^-8) plus ``tol``, and equal to the rounded ``want`` bit for bit but where the
    float32 sums straddle a rounding boundary (>= 99 % of the values)."""
    for n, a, b in zip(names, got, want, strict=True):
        assert (a is None) == (b is None), n
        if a is None:
            continue
        assert a.dtype in (jnp.float32, jnp.bfloat16) and a.shape == b.shape, n
        bound = tol if a.dtype == jnp.float32 else 2 ** -8 + tol
        assert rel_err(a, b) <= bound, f"{n}: relative max error {rel_err(a, b):.3g} > {bound}"
        if a.dtype == jnp.bfloat16:
            assert np.mean(np.asarray(a) == np.asarray(b.astype(a.dtype))) >= 0.99, n


WY = ("W", "U", "kw_tail", "q_dec", "P", "gamma_C")
GRADS = ("dq", "dk", "dkw", "dv", "dbeta", "dg")


@pytest.mark.parametrize("c", [16, 32, 64])
def test_unit_lower_inverse_of_similar_keys(c):
    """(I + L)^-1 for L = strict_tril(Diag(β) K K̃ᵀ) with keys of mean cosine ~0.7 (entries of
    L ~0.5): within 1e-5 of float64's inverse at float32 dots. (The doubling product it replaced
    was off by O(1) at C = 64 here: its powers of L reach ~1e7 before they cancel.)"""
    rng = np.random.default_rng(c)
    z = rng.standard_normal((c, 32)) + 1.5 * rng.standard_normal((1, 32))
    k = z / np.linalg.norm(z, axis=1, keepdims=True)
    kw = k * rng.uniform(0.5, 2.0, k.shape)
    L = np.tril(rng.uniform(0.05, 0.95, (c, 1)) * (k @ kw.T), -1)
    exact = np.linalg.inv(np.eye(c) + L)
    got = unit_lower_inverse(jnp.asarray(L, jnp.float32), Dots("ieee", interpret=True))
    assert np.abs(np.asarray(got, np.float64) - exact).max() <= 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("decay", ["none", "scalar"])
@pytest.mark.parametrize("block_v, k_dim, block_k", [(16, K, 64), (64, K, 64), (16, 32, 16)])
def test_fp32_matches_prepare(rand, decay, block_v, k_dim, block_k):
    """fp32: outputs and every cotangent (measured errors <= 3e-7); block_v 16: two value tiles;
    K = 32 with block_k 16: two key tiles in the forward and in each sweep of the pullback."""
    ins = inputs(rand, decay, jnp.float32, k_dim)
    want_wy, pullback = oracle(decay, ins)
    cts = tuple(rand.normal(*w.shape) for w in want_wy)
    want_grads = pullback(cts)
    got_wy, got_grads = kernels(ins, cts, block_v, block_k)
    check(got_wy, want_wy, 2e-6, WY)
    check(list(got_grads) + [None] * (decay == "none"), want_grads, 2e-6, GRADS)


def test_apply_dots_round_w_and_u_operands(rand):
    """``apply_dots`` = bf16: W = T Diag(β) K and U = T Diag(β) V from bf16-rounded operands
    (float32 sums), T itself and P as with the forward's own dots (no decay: Γ = 1)."""
    ins = inputs(rand, "none", jnp.float32, 32)
    opts = dict(chunk=C, block_v=16, block_k=16, dots=DOTS, num_warps=4, num_stages=1)
    exact, rounded = (jax.jit(functools.partial(wy_fwd, **opts, apply_dots=d))(*ins)
                      for d in (None, Dots("bf16", interpret=True)))
    np.testing.assert_array_equal(exact[-1], rounded[-1])  # T
    np.testing.assert_array_equal(exact[4], rounded[4])  # P
    bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731
    T = bf(exact[-1]).reshape(B, H, NC, C, C)
    beta = np.asarray(ins[4]).transpose(0, 2, 1).reshape(B, H, NC, C, 1)
    for got, want_exact, x in ((rounded[0], exact[0], ins[1]), (rounded[1], exact[1], ins[3])):
        x = np.asarray(x).transpose(0, 2, 1, 3).reshape(B, H, NC, C, -1)
        want = np.einsum("bhcij,bhcjd->bhcid", T, bf(beta * x)).reshape(got.shape)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
        assert rel_err(got, want_exact) > 1e-4  # the operands were rounded


@pytest.mark.parametrize("decay", ["none", "scalar"])
@pytest.mark.parametrize("t_dtype", [jnp.float32, jnp.bfloat16])
def test_inverse_alone_is_the_same(rand, decay, t_dtype):
    """``wy_inverse`` (P, Γ_C and T only, no values read) returns ``wy_fwd``'s P, Γ_C and T
    bitwise, T in either stored dtype (bf16 inputs and outputs, K = 32 with two key tiles)."""
    ins = inputs(rand, decay, jnp.bfloat16, 32)
    opts = dict(chunk=C, block_k=16, dots=DOTS, num_warps=4, num_stages=1,
                out_dtype=jnp.bfloat16, t_dtype=t_dtype)
    one = jax.jit(functools.partial(wy_fwd, **opts, block_v=16))(*ins)[4:]
    two = jax.jit(functools.partial(wy_inverse, **opts))(*ins[:3], *ins[4:])
    for name, a, b in zip(("P", "gc", "T"), one, two):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)


@pytest.mark.parametrize("decay", ["none", "scalar"])
def test_bf16_inputs(rand, decay):
    """bf16 q, k, kw, v, β: the kernels compute in float32 on the bf16 values, so they match
    ``prepare`` on the same values in float32 as tightly as fp32 inputs do; the cotangents are
    stored in the inputs' dtype: that float32 pullback rounded once (all but the rare values
    whose float32 sums straddle a rounding boundary equal to it bit for bit), and
    ``prepare``'s bf16 pullback up to that one rounding."""
    ins = inputs(rand, decay, jnp.bfloat16)
    want_wy, pullback = oracle(decay, ins)
    cts = tuple(rand.normal(*w.shape) for w in want_wy)
    got_wy, got_grads = kernels(ins, cts, 16)
    check(got_wy, want_wy, 2e-6, WY)
    check(list(got_grads) + [None] * (decay == "none"), pullback(cts), 2e-6, GRADS)
    for name, a in zip(GRADS, got_grads):
        assert a.dtype == ins[GRADS.index(name)].dtype, name  # g stays float32
    bf16_grads = oracle(decay, ins, jnp.bfloat16)[1](cts)
    for name, a, b in zip(GRADS, got_grads, bf16_grads):
        assert b.dtype == ins[GRADS.index(name)].dtype, name
        assert rel_err(a.astype(b.dtype), b) <= 2 ** -8, name


def test_vector_decay_is_refused(rand):
    q, k, kw, v, beta, *_ = inputs(rand, "none", jnp.float32)
    g = rand.normal(*q.shape)  # per-channel
    with pytest.raises(ValueError, match="g must be None or"):
        wy_fwd(q, k, kw, v, beta, g, chunk=C, block_v=16, dots=DOTS, num_warps=4,
               num_stages=1)


@pytest.mark.parametrize("decay", ["none", "scalar"])
def test_pullback_takes_P_exactly_with_a_decay(rand, decay):
    """wy_bwd reads the forward's P for a decay's E term: missing (scalar) or stray (none) is a
    ValueError naming P, not a silently wrong dg."""
    ins = inputs(rand, decay, jnp.float32)
    x = jnp.zeros((B, H, ins[0].shape[1], C), jnp.float32)
    with pytest.raises(ValueError, match="P"):
        wy_bwd(*ins[:6], x, *([None] * 6), P=None if decay == "scalar" else x, chunk=C, block_v=16,
               dots=DOTS, num_warps=4, num_stages=1)


GRADS_SUMS = GRADS[:-1] + ("dgamma", "dsigma")  # the per-channel kernels' cotangents


def vector_case(rand, c, k_dim, dtype, block_k, decays, bound=None):
    """(the kernels' WY outputs, pullback; ``prepare_sums``', on the same values in float32) for
    per-channel decays −U(lo, hi) per token, ``decays`` a list of (lo, hi), one per equal run of
    key columns; ``bound``: both kernels' factoring bound (None: each its default)."""
    Tp = NC * c
    x = rand.delta_inputs(B, Tp, H, k_dim, V, decay="vector", dtype=dtype)
    lo, hi = (jnp.repeat(jnp.asarray(r, jnp.float32), k_dim // len(decays)) for r in zip(*decays))
    g = -(lo + (hi - lo) * jnp.asarray(rand.rng.uniform(size=(B, NC, c, H, k_dim)), jnp.float32))
    ins = (x["q"], x["k"], x["write_key"], x["v"], x["beta"], *gamma_sigma(g))
    prepare, pullback, fwd, bwd = vector_programs(c, block_k, bound)
    want_wy = prepare(*(a.astype(jnp.float32) for a in ins))
    cts = tuple(rand.normal(*w.shape) for w in want_wy)
    *got_wy, T = fwd(*ins[:6])
    got_grads = bwd(*ins[:6], T, *cts)
    return (got_wy, got_grads), (want_wy, pullback(tuple(a.astype(jnp.float32) for a in ins), cts))


@functools.cache
def vector_programs(c, block_k, bound):
    """Jitted ``prepare_sums``, its pullback (args, cts), ``wy_vector_fwd`` and ``wy_vector_bwd``
    for ``vector_case``: one object each a configuration, so that the cases sharing one compile
    it once a process (the suite's time; a test that monkeypatches clears JAX's caches, so that
    its patches are traced)."""
    cfg = dr._Config(c, "vector", 1.0, None, dr.Options(), DOTS, DOTS)
    prepare = functools.partial(dr.prepare_sums, cfg)
    opts = dict(chunk=c, block_v=16, block_k=block_k, dots=DOTS, num_warps=4, num_stages=1)
    opts |= {} if bound is None else dict(bound=bound)
    return (jax.jit(prepare), jax.jit(lambda args, cts: jax.vjp(prepare, *args)[1](cts)),
            jax.jit(functools.partial(wy_vector_fwd, **opts)),
            jax.jit(functools.partial(wy_vector_bwd, **opts)))


@pytest.mark.parametrize("c, k_dim, dtype, block_k", [
    (16, 16, jnp.float32, 64), (32, 32, jnp.float32, 64), (32, 16, jnp.float32, 64),
    (32, 16, jnp.bfloat16, 64), (32, 32, jnp.float32, 16)])
def test_vector_decay_matches_prepare(rand, c, k_dim, dtype, block_k):
    """Per-channel decay: outputs and every cotangent against ``prepare``. Decays down to −20 per
    token (exp(γ_i − γ_j) over a chunk would overflow; Γ underflows to 0 in places; the grams
    by halving). K = 32 with block_k 16: the grams summed over two key tiles, the pullback tile
    by tile."""
    (got_wy, got_grads), (want_wy, want_grads) = vector_case(rand, c, k_dim, dtype, block_k,
                                                             [(0.01, 20.0)])
    check(got_wy, want_wy, 2e-6, WY)
    check(got_grads, want_grads, 2e-6, GRADS_SUMS)


MILD = [(0.01, 0.5)] * 3  # the first 24 of 32 key columns
PATHS = [((0.01, 0.5), 64, 16, True),
         ((3.0, 4.5), 64, 16, False), ((3.0, 4.5), 64, 8, True),
         ((11.0, 19.0), 64, 4, False), ((11.0, 19.0), 64, 2, True),
         ((45.0, 60.0), 64, 1, False),
         ((11.0, 19.0), 16, 4, False), ((11.0, 19.0), 16, 2, True)]
PATH_IDS = ["s32_whole", "s16_runs_16", "s16_skips_8", "s4_runs_4", "s4_skips_2", "s1_runs_1",
            "tiles_s32_s4_run_4", "tiles_s32_s4_skip_2"]


@pytest.mark.parametrize("strong, block_k", [p[:2] for p in PATHS], ids=PATH_IDS)
def test_vector_decay_paths_exact_unpoisoned(rand, strong, block_k):
    """The cases of ``test_vector_decay_paths`` unpoisoned, at the kernels' own bounds (the
    forward's 72 factors 3-4.5 whole, its entries above the diagonal overflowing to inf, 45-60
    in 2-row blocks): every one exact against ``prepare_sums``."""
    (got_wy, got_grads), (want_wy, want_grads) = vector_case(rand, 32, 32, jnp.float32, block_k,
                                                             MILD + [strong])
    check(got_wy, want_wy, 2e-6, WY)
    check(got_grads, want_grads, 2e-6, GRADS_SUMS)


@pytest.mark.parametrize("strong, block_k, poisoned, exact", PATHS, ids=PATH_IDS)
def test_vector_decay_paths(rand, monkeypatch, strong, block_k, poisoned, exact):
    """Which halving levels each key tile runs (C = 32, K = 32; an s-block spreads s / 2 tokens
    from its middle row). The last 8 key columns decay by ``strong`` a token, the rest by
    0.01-0.5; the spread is a max over a tile's columns, so at both kernels' bound pinned to 40
    0.01-0.5 factors whole (s = 32), 3-4.5 in 16-row blocks (8 x 4.5 <= 40 < 16 x 3), 11-19 in
    4-row blocks, 45-60 only row by row (s = 1); with block_k 16 a mild tile (s = 32) and a
    strong one (s = 4). Halving level h = ``poisoned`` has its results moved: "exact" shows it
    did not run in the forward or the pullback, not exact that it did (levels h >= s run);
    unpoisoned: ``test_vector_decay_paths_exact_unpoisoned``. (Mild columns keep dγ well
    conditioned: where every column decays by > 10 a token dγ ~ e^-11 is a difference of O(1)
    terms, and fp32 rounding is all of it: 2.6e-3 relative for the XLA reference itself against
    float64 at 11-19 a token.)"""
    decays = MILD + [strong]
    from pallas_kernels import wy_vector_triton as wv
    real = wv._level

    def level(g, g_ref, cols, h):
        ex, ey, M = real(g, g_ref, cols, h)
        return (ex + 1.0, ey + 1.0, M) if h == poisoned else (ex, ey, M)

    monkeypatch.setattr(wv, "_level", level)
    (got_wy, got_grads), (want_wy, want_grads) = vector_case(rand, 32, 32, jnp.float32, block_k,
                                                             decays, bound=40.0)
    errs = [rel_err(a, b) for a, b in zip([*got_wy, *got_grads], [*want_wy, *want_grads])]
    assert max(errs) <= 2e-6 if exact else max(errs) > 1e-2


@pytest.mark.parametrize("strong, bound, forward_exact, pullback_exact", [
    ((0.01, 0.5), 40.0, True, True), ((3.0, 4.5), 40.0, False, False),
    ((3.0, 4.5), None, True, False)],
    ids=["whole_skips_search", "s16_searches", "forward_factors_wider"])
def test_vector_whole_chunk_path_apart(rand, monkeypatch, strong, bound, forward_exact,
                                       pullback_exact):
    """A key tile that factors whole takes one dot through the chunk's middle row and never the
    block-size search's path (``_block`` poisoned: exact), a tile that does not takes it (not
    exact): C = K = 32, decays as ``test_vector_decay_paths``, at one bound for both kernels or
    at their own (None: the forward's 72 factors 3-4.5 a token whole, the pullback's 40 does
    not)."""
    from pallas_kernels import wy_vector_triton as wv
    real = wv._block

    def block(*args):  # the blocks' entries doubled
        ex, ey, M = real(*args)
        return 2.0 * ex, ey, M

    monkeypatch.setattr(wv, "_block", block)
    (got_wy, got_grads), (want_wy, want_grads) = vector_case(rand, 32, 32, jnp.float32, 64,
                                                             MILD + [strong], bound)
    for got, want, exact in ((got_wy, want_wy, forward_exact),
                             (got_grads, want_grads, pullback_exact)):
        err = max(rel_err(a, b) for a, b in zip(got, want))
        assert err <= 2e-6 if exact else err > 1e-2


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_dg_where_every_channel_decays_away(rand, monkeypatch, decay):
    """Decays of 11-19 a token (per head or in every key column): each gram entry off the
    diagonal is below e^-11, so dγ is ~1e-5 of the terms it is formed from. The kernels and the
    plain-JAX chunk step (``prepare``) keep the diagonal (free of γ) out of dγ and K̃' on σ
    instead of adding and cancelling their shares (that rounding was 3e-3 relative), and sum
    dg_t from dγ and dσ with only its own terms: every cotangent of both in float32 within
    1e-5 of ``prepare`` in float64. The decays are multiples of 2^-6, so that their in-chunk
    sums (up to 19 x 32 < 2^10) are exact in float32 and the comparison sees the dγ terms'
    rounding, not γ's (float32's ulp at |γ| ~ 600 alone moves e^(γ_i − γ_j) by ~1e-5)."""
    c, k_dim = 32, 32
    Tp = NC * c
    x = rand.delta_inputs(B, Tp, H, k_dim, V, decay="vector")
    shape = (B, NC, c, H) + ((k_dim,) if decay == "vector" else ())
    g = -jnp.round(64 * (11.0 + 8.0 * jnp.asarray(rand.rng.uniform(size=shape), jnp.float32))) / 64
    vector = decay == "vector"
    base = (x["q"], x["k"], x["write_key"], x["v"], x["beta"])
    ins = base + (gamma_sigma(g) if vector else (flat(g),))
    oracle = dr.prepare_sums if vector else dr.prepare  # the per-channel kernels take γ, σ
    cfg = dr._Config(c, decay, 1.0, None, dr.Options(), DOTS, DOTS)
    wy32, pullback32 = jitted_vjp(functools.partial(oracle, cfg), *ins)
    cts = tuple(rand.normal(*w.shape) for w in wy32)
    opts = dict(chunk=c, block_v=16, block_k=64, dots=DOTS, num_warps=4, num_stages=1)
    fwd, bwd = (wy_vector_fwd, wy_vector_bwd) if vector else (wy_fwd, wy_bwd)
    *wy, T = jax.jit(functools.partial(fwd, **opts))(*ins[:6])
    P = {} if vector else dict(P=wy[4])
    got = jax.jit(functools.partial(bwd, **opts))(*ins[:6], T, *cts, **P)
    real_view = dr._chunk_view
    monkeypatch.setattr(dr, "_chunk_view", lambda a, chunk: real_view(a, chunk).astype(jnp.float64))
    with jax.enable_x64(True):
        wy64, pullback64 = jitted_vjp(functools.partial(oracle, cfg),
                                      *(a.astype(jnp.float64) for a in ins))
        want = pullback64(tuple(ct.astype(w.dtype) for ct, w in zip(cts, wy64)))
        want = [np.asarray(w, np.float64) for w in want]
    names = GRADS_SUMS if vector else GRADS
    check(got, want, 1e-5, names)
    check(pullback32(cts), want, 1e-5, names)


@pytest.mark.parametrize("decay, factored_blocks", [("vector", True), ("vector", False),
                                                    ("scalar", None), ("scalar", "inverse")])
def test_wy_kernels_lower_for_cuda(decay, factored_blocks):
    """The WY forward and pullback go through the Triton lowering for CUDA (no GPU needed: an
    abstract H100 mesh), the scalar ones with their in-kernel sums of the log decays (also as
    the split forward's two kernels), the per-channel ones with the block-size search and the
    levels' conds; K = V = 128, C = 64, bf16, warps as on the device; ``wy_inverse``
    alone too."""
    b, t, c = 2, 128, 64
    vector = decay == "vector"
    ins = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        *[((b, t, H, 128), jnp.bfloat16)] * 4, ((b, t, H), jnp.bfloat16),
        ((b, t, H) + (128,) * vector, jnp.float32)]]
    opts = dict(chunk=c, block_v=64, block_k=64, dots=Dots(precision="tf32"),
                num_warps=8 if vector else 4, num_stages=2)
    fwd, bwd = (wy_vector_fwd, wy_vector_bwd) if vector else (wy_fwd, wy_bwd)
    if vector:
        opts["factored_blocks"] = factored_blocks
    if factored_blocks == "inverse":
        opts.pop("block_v")
        inverse = lambda q, k, kw, v, *rest: wy_inverse(q, k, kw, *rest, **opts)  # noqa: E731
        assert triton_kernels_lowered_for_cuda(inverse, ins, grad=False) == 1
        return

    def both(*xs):
        *wy, T = fwd(*xs, **opts)
        return bwd(*xs, T, *[jnp.ones(w.shape, jnp.float32) for w in wy], **opts,
                   **({} if vector else dict(P=wy[4])))

    assert triton_kernels_lowered_for_cuda(both, ins, grad=False) == 2


def test_vector_decay_shape_is_checked(rand):
    q, k, kw, v, beta, *_ = inputs(rand, "none", jnp.float32)
    with pytest.raises(ValueError, match="gamma must be"):
        wy_vector_fwd(q, k, kw, v, beta, beta, chunk=C, block_v=16, dots=DOTS, num_warps=4,
                      num_stages=1)


def test_vector_search_ends_on_nan_gates(monkeypatch):
    """A NaN in γ: the block-size search ends (the NaN counts as factorable and goes on into
    the results) instead of searching below s = 1 forever (on a GPU: a hung kernel)."""
    from pallas_kernels import wy_vector_triton as wv
    real, calls = wv._to_middles, []

    def counted(*args):
        calls.append(args[-1])
        assert len(calls) <= 8, f"the search went on past s = 1: {calls}"
        return real(*args)

    monkeypatch.setattr(wv, "_to_middles", counted)
    g = -jnp.cumsum(jnp.full((16, 8), 0.1, jnp.float32), axis=0).at[5, 3].set(jnp.nan)
    with jax.disable_jit():
        assert 0 <= int(wv._block_size(g, g, slice(0, 8), 3, wv.FORWARD_BOUND)) <= 3
