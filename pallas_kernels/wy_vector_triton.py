"""Per-chunk WY tensors of the delta core with a per-channel (KDA) decay and their pullback,
Pallas Triton lowering: ``wy_triton``'s grid, layout and formulas with γ [C, K] per channel.

In a chunk (γ the cumulative log decay from the chunk start per channel, non-increasing down the
rows, Γ = exp γ, e_ij = exp(γ_i − γ_j) [K]):

    A_ij = Σ_k k_ik k̃_jk e_ijk    P_ij = Σ_k q_ik k̃_jk e_ijk    (i >= j, else 0)
    L = strict_tril(Diag(β) A)    T = (I + L)^-1                  (block merges)
    W = T Diag(β)(K ⊙ Γ)    U = T Diag(β) V    K̃' = K̃ ⊙ exp σ    Q' = Q ⊙ Γ    Γ_C = exp γ_C [K]

(σ = γ_C − γ as in ``wy_triton``: formed from γ, its cotangent returned apart.)

exp(γ_i − γ_j) overflows over a whole chunk for i < j. Per key tile, s is the largest power of two
<= C for which every |γ_i − γ_m(i)| <= b, m(i) = s⌊i/s⌋ + s/2 the middle row of i's block of s
rows (s = 1 always qualifies: m(i) = i). The entries within one s-block are one factored dot
through the middle rows, masked to i > j (as with a scalar decay):

    A_ij = Σ_k (k_ik exp(γ_ik − γ_m,k)) (k̃_jk exp(γ_m,k − γ_jk))     (every factor <= e^b)

The bound b is the forward's ``FORWARD_BOUND`` = 72: a kept entry's two factors multiply to at
most 1, the entries outside the mask may overflow to inf (discarded), and a factor e^-72 times
a key entry stays a normal float32 down to |k̃| ~ 2e-7 (at 80, jla's, a key entry below ~7e-4
would flush). The pullback's ``PULLBACK_BOUND`` = 40: its products are cotangents times
factors, and e^40 leaves them room up to e^48 before float32 overflows. s = C (a chunk that
decays by at most ~2b per channel) is the whole gram in one dot through the middle row, tested
first and kept apart from the search for s (``lax.cond``); at the bench's layer gates (init
values, 64-wide key tiles) 73 % of tiles take it at b = 72, 25 % at b = 40. The entries
across s-blocks by halving: at level h = C/2, C/4, ..., s the rows fall into blocks of 2h, each
an upper and a lower half, and with r(i) = 2h⌊i/2h⌋ + h (the first row of i's lower half) the
entries (i in a lower half, j in the upper half of the same block) are

    A_ij = Σ_k (k_ik exp(γ_ik − γ_r,k)) (k̃_jk exp(γ_r,k − γ_jk))     (both exponents <= 0)

one masked [C, C] dot a level: log2(C / s) + 1 dots a gram and key tile, each entry below the
diagonal once, exact for any decay (entries a dot computes outside its mask may overflow; they are
discarded). The forward takes the diagonal in the s-block dot (i >= j); the pullback takes it
apart, as Σ_k k_ik k̃_ik, free of γ: through a factored dot its dγ terms would cancel only to
rounding, which where the neighbours have decayed away is all of dγ. The levels below s are
skipped by ``lax.cond``; the pullback runs the same search (no grams) at its own bound: any
exact split of the grams' entries serves, the forward's need not be repeated.

Pullback (cotangents dW, dU, dK̃', dQ', dP, dΓ_C [K]): with dT, dL as in ``wy_triton``,
G_K = Diag(β) dL, G_Q = tril(dP) and the grams' pullback through its blocks,

    Z = Σ_j dL_ij k̃_j ⊙ e_ij    dK_A = Diag(β) Z    dQ_P = Σ_j G_Q,ij k̃_j ⊙ e_ij
    dK̃_AP = Σ_i (G_K,ij k_i + G_Q,ij q_i) ⊙ e_ij
    dK = dK_A + Diag(β) Γ ⊙ Tᵀ dW    dQ = dQ_P + dQ' ⊙ Γ    dK̃ = dK̃_AP + dK̃' ⊙ exp σ
    dV = Diag(β) Tᵀ dU    dβ = rowsum(K ⊙ Z) + rowsum(Γ ⊙ K ⊙ Tᵀ dW) + rowsum(Tᵀ dU ⊙ V)
    dγ = K ⊙ dK_A + Q ⊙ dQ_P − K̃ ⊙ dK̃_AP + Diag(β) Γ ⊙ K ⊙ Tᵀ dW + dQ' ⊙ Q'
         + δ_{i,C−1} Γ_C ⊙ dΓ_C
    dσ = dK̃' ⊙ K̃'

(rowsum(K ⊙ Z) = rowsum(dL ⊙ A): the pullback needs no A. A and P depend on γ only through γ_i −
γ_j, so their part of dγ is the first three terms; the reference rows get none.) This is the
exact pullback of ``delta_rule.prepare``. The diagonal's share of dγ cancels exactly and is left
out rather than formed (A_ii, P_ii have no γ); where a chunk decays by > 10 a token, dγ is ~1e-5
of those terms and their rounding would be all of it (as K̃' through σ = γ_C − γ would:
``wy_triton``).
"""

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.triton_common import Dots, iota2, out_struct, unit_lower_inverse
from pallas_kernels.wy_triton import call, layout, tiles, u_bwd, u_fwd, wy_shapes

f32 = jnp.float32
FORWARD_BOUND = 72.0  # the forward's |γ_i − γ_m| up to which a block factors through row m
PULLBACK_BOUND = 40.0  # the pullback's (module docstring)


def _row_ids(C, K):
    """Row index of each entry of a [C, K] tile."""
    return lax.broadcasted_iota(jnp.int32, (C, K), 0)


def _heights(C):
    """The halving levels h = C/2, ..., 1 with log2 h."""
    return [(C >> n, (C >> n).bit_length() - 1) for n in range(1, C.bit_length())]


def _level(g, g_ref, cols, h):
    """(ex, ey, M) of halving level h (module docstring): ex = exp(γ − γ_r) on lower-half rows,
    ey = exp(γ_r − γ) on upper-half rows (0 elsewhere) [C, BK] for the key columns ``cols`` (g = γ
    there; γ_r gathered row by row from ``g_ref``), and M [C, C] the level's entries, those that
    (X ⊙ ex)(Y ⊙ ey)ᵀ gives."""
    C, BK = g.shape
    rows = lax.broadcasted_iota(jnp.int32, (C,), 0)
    i, j = iota2(C)
    gr = g_ref[rows // (2 * h) * (2 * h) + h, cols].astype(f32)
    low = _row_ids(C, BK) % (2 * h) >= h
    ex = jnp.exp(jnp.where(low, g - gr, -jnp.inf))
    ey = jnp.exp(jnp.where(low, -jnp.inf, gr - g))
    return ex, ey, (i // (2 * h) == j // (2 * h)) & (i % (2 * h) >= h) & (j % (2 * h) < h)


def _to_middles(g, g_ref, cols, ls):
    """γ − γ_m(i) [C, BK] for the key columns ``cols`` (g = γ there), m(i) the middle row of i's
    block of s = 2^ls rows (``ls`` may be traced)."""
    rows = lax.broadcasted_iota(jnp.int32, (g.shape[0],), 0)
    middle = ((rows >> ls) << ls) + ((1 << ls) >> 1)
    return g - g_ref[middle, cols].astype(f32)


def _factorable(x, bound):
    """Whether no |x| exceeds bound (reduced one axis at a time, as the lowering takes it). A
    NaN counts as factorable: the block-size search ends there and the NaN goes on into the
    results (asked as ``max <= bound``, a NaN in γ kept the search going below s = 1 forever,
    a hung kernel)."""
    return jnp.logical_not(jnp.max(jnp.max(jnp.abs(x), axis=1)) > bound)


def _to_middle(g, g_ref, cols):
    """γ − γ_{C/2} [C, BK] for the key columns ``cols`` (g = γ there): the factors of s = C,
    the middle row read once and broadcast (``_to_middles`` at s = C gathers it row by row)."""
    return g - g_ref[g.shape[0] // 2, cols].astype(f32)[None, :]


def _block_size(g, g_ref, cols, top, bound):
    """log2 s (module docstring): from s = 2^top down to the first block size whose blocks all
    factor within ``bound``."""
    def shrink(carry):
        ls = carry[0] - 1
        return ls, _factorable(_to_middles(g, g_ref, cols, ls), bound)

    return lax.while_loop(lambda carry: jnp.logical_not(carry[1]), shrink,
                          (top, _factorable(_to_middles(g, g_ref, cols, top), bound)))[0]


def _block(g, g_ref, cols, ls, diagonal):
    """(ex, ey, M) of the factored s-blocks (s = 2^ls): ex = exp(γ − γ_m), ey = exp(γ_m − γ)
    [C, BK] and M [C, C] the entries i > j (i >= j with ``diagonal``) within one block."""
    x = _to_middles(g, g_ref, cols, ls)
    i, j = iota2(g.shape[0])
    return jnp.exp(x), jnp.exp(-x), ((i > j) | (diagonal & (i == j))) & ((i >> ls) == (j >> ls))


def _gram_blocks(grams, rows, kw, ex, ey, M, dots):
    """grams + the entries M of (Z ⊙ ex)(K̃ ⊙ ey)ᵀ for each left factor Z in ``rows``."""
    Y = kw * ey
    return tuple(X + jnp.where(M, dots.nt(Z * ex, Y), 0.0) for X, Z in zip(grams, rows))


def _tile(refs, cols):
    """The key columns ``cols`` of each ref, float32 [C, BK]."""
    return [r[:, cols].astype(f32) for r in refs]


def _whole(g, g_ref, cols, bound):
    """(γ − γ_{C/2}, whether the whole chunk factors through row C/2 within ``bound``, log2 s to
    start from): log2 C where it does, else the block-size search's first candidate log2 C − 1;
    traced (the Triton lowering cannot yield a literal from a branch)."""
    x = _to_middle(g, g_ref, cols)
    whole = _factorable(x, bound)
    return x, whole, g.shape[0].bit_length() - 2 + whole.astype(jnp.int32)


def _tile_grams(grams, rows, kw, g, g_ref, cols, dots, factored_blocks, bound):
    """grams + one key tile's share (``_grams``): the whole chunk in one factored dot
    where it factors (s = C, the common case, kept apart from the search: run 51 measured the
    general path at s = C 0.55 ms slower in the forward), else s by ``_block_size``, the halving
    levels h >= s and the s-blocks (module docstring; s = 1 without ``factored_blocks``). The
    forward's diagonal rides in the block dots (only dγ needs it apart, ``_diagonal_vjp``)."""
    C = g.shape[0]

    def general(grams, ls):  # ls: the first candidate, log2 C − 1
        ls = _block_size(g, g_ref, cols, ls, bound) if factored_blocks else jnp.int32(0)
        for h, lh in _heights(C):
            grams = lax.cond(lh >= ls,
                             lambda gr, h=h: _gram_blocks(gr, rows, kw,
                                                          *_level(g, g_ref, cols, h), dots),
                             lambda gr: gr, grams)
        return _gram_blocks(grams, rows, kw, *_block(g, g_ref, cols, ls, True), dots)

    if not factored_blocks:
        return general(grams, None)
    x, whole, start = _whole(g, g_ref, cols, bound)
    i, j = iota2(C)
    return lax.cond(
        whole,
        lambda gr, ls: _gram_blocks(gr, rows, kw, jnp.exp(x), jnp.exp(-x), i >= j, dots),
        general, grams, start)


def _grams(q_ref, k_ref, kw_ref, g_ref, dots, key_tiles, factored_blocks, bound):
    """(A, P) [C, C] (module docstring; zero above the diagonal), summed over the key tiles."""
    C = k_ref.shape[0]
    grams = (jnp.zeros((C, C), f32),) * 2
    for cols in key_tiles:
        q, k, kw, g = _tile((q_ref, k_ref, kw_ref, g_ref), cols)
        grams = _tile_grams(grams, (k, q), kw, g, g_ref, cols, dots, factored_blocks, bound)
    return grams


def _tile_size(g_ref, cols, factored_blocks, bound):
    """log2 s of the key columns ``cols`` as ``_tile_grams`` picks it within ``bound``, without
    the grams: log2 C where the whole chunk factors, else ``_block_size``'s search (0 without
    ``factored_blocks``)."""
    if not factored_blocks:
        return jnp.int32(0)
    g = g_ref[:, cols].astype(f32)
    _, whole, start = _whole(g, g_ref, cols, bound)
    return lax.cond(whole, lambda ls: ls, lambda ls: _block_size(g, g_ref, cols, ls, bound),
                    start)


def _blocks_vjp(GK, GQ, q, k, kw, ex, ey, M, dots):
    """The pullback of ``_gram_blocks``'s entries M along (G_K, G_Q): (dK, dQ, dK̃) [C, BK]."""
    GKm, GQm = jnp.where(M, GK, 0.0), jnp.where(M, GQ, 0.0)
    Y = kw * ey
    return (dots.nn(GKm, Y) * ex, dots.nn(GQm, Y) * ex,
            (dots.tn(GKm, k * ex) + dots.tn(GQm, q * ex)) * ey)


def _add(xs, ys):
    return tuple(x + y for x, y in zip(xs, ys))


def _grams_vjp(GK, GQ, q, k, kw, g, g_ref, cols, ls, dots):
    """(dK_A, dQ_P, dK̃_AP) [C, BK] for the key columns ``cols`` (q, k, kw, g their tiles): the
    pullback of (A, P) = ``_grams`` along (G_K, G_Q) in K, Q and K̃ (module docstring), through
    the same whole chunk, or levels and blocks, as there (``ls``: the tile's log2 s from
    ``_grams``), without the diagonal's share (``_diagonal_vjp``)."""
    C = g.shape[0]
    i, j = iota2(C)

    def whole():
        x = _to_middle(g, g_ref, cols)
        return _blocks_vjp(GK, GQ, q, k, kw, jnp.exp(x), jnp.exp(-x), i > j, dots)

    def general():
        acc = _blocks_vjp(GK, GQ, q, k, kw, *_block(g, g_ref, cols, ls, False), dots)
        for h, lh in _heights(C):
            acc = lax.cond(lh >= ls,
                           lambda a, h=h: _add(a, _blocks_vjp(GK, GQ, q, k, kw,
                                                              *_level(g, g_ref, cols, h), dots)),
                           lambda a: a, acc)
        return acc

    return lax.cond(ls == C.bit_length() - 1, whole, general)


def _diagonal_vjp(gq, q, kw):
    """The diagonal's share of ``_grams``' pullback (P_ii = Σ q_i k̃_i, gq [C, 1] its
    cotangents; A_ii is not in L): (dQ, dK̃) [C, BK]. Kept out of dγ: it has no γ in it, and as
    a difference of two rounded products it would be all of dγ where a chunk decays away."""
    return gq * kw, gq * q


def _fwd_kernel(q_ref, k_ref, kw_ref, v_ref, beta_ref, g_ref, W_ref, U_ref, kwt_ref, qd_ref,
                P_ref, gc_ref, T_ref, *, dots, block_v, block_k, factored_blocks, bound):
    """One chunk's W, U, K̃', Q', P, Γ_C and T (module docstring), by key tiles of ``block_k``."""
    C, K = k_ref.shape
    key_tiles = tiles(K, block_k)
    A, P = _grams(q_ref, k_ref, kw_ref, g_ref, dots, key_tiles, factored_blocks, bound)
    beta = beta_ref[...].astype(f32)
    i, j = iota2(C)
    T = unit_lower_inverse(jnp.where(i > j, beta[:, None] * A, 0.0), dots)
    T_ref[...] = T
    P_ref[...] = P.astype(P_ref.dtype)
    b = beta[:, None]
    u_fwd(T, b, v_ref, U_ref, dots, block_v)
    for cols in key_tiles:
        q, k, kw, g = _tile((q_ref, k_ref, kw_ref, g_ref), cols)
        g_last = g_ref[C - 1, cols].astype(f32)
        Gam = jnp.exp(g)
        W_ref[:, cols] = dots.nn(T, b * Gam * k).astype(W_ref.dtype)
        kwt_ref[:, cols] = (kw * jnp.exp(g_last[None, :] - g)).astype(kwt_ref.dtype)
        qd_ref[:, cols] = (q * Gam).astype(qd_ref.dtype)
        gc_ref[cols] = jnp.exp(g_last)


def _bwd_kernel(q_ref, k_ref, kw_ref, v_ref, beta_ref, g_ref, T_ref, dW_ref, dU_ref, dkwt_ref,
                dqd_ref, dP_ref, dgc_ref, dq_ref, dk_ref, dkw_ref, dv_ref, db_ref, dg_ref, ds_ref,
                *, dots, block_v, block_k, factored_blocks, bound):
    """One chunk's dQ, dK, dK̃, dV, dβ, dγ and dσ (module docstring), T read from the forward, in two
    sweeps over key tiles of ``block_k`` (dT and dβ's W and U shares first; then, after dL, each
    tile's cotangents, Tᵀ dW recomputed per tile). A is not recomputed: the gram's pullback
    runs along dL itself, Z = Σ_j dL_ij k̃_j ⊙ e_ij, so that dK_A = Diag(β) Z and dβ's gram share
    rowsum(dL ⊙ A) = rowsum(K ⊙ Z) (as FLA's KDA pullback forms it); each tile's block size
    comes from the search alone (``_tile_size``)."""
    C, K = k_ref.shape
    key_tiles = tiles(K, block_k)
    sizes = [_tile_size(g_ref, cols, factored_blocks, bound) for cols in key_tiles]
    T = T_ref[...]
    i, j = iota2(C)
    beta = beta_ref[...].astype(f32)
    b = beta[:, None]
    # sweep 1: W = T Diag(β)(K ⊙ Γ), U = T Diag(β) V
    dT, db = u_bwd(T, b, v_ref, dU_ref, dv_ref, dots, block_v)
    for cols in key_tiles:
        k, g = _tile((k_ref, g_ref), cols)
        dW = dW_ref[:, cols]
        Gk = jnp.exp(g) * k
        db = db + jnp.sum(Gk * dots.tn(T, dW), axis=1)
        dT = dT + dots.nt(dW, b * Gk)
    # T = (I + L)^-1, L = strict_tril(Diag(β) A); P = tril(...)
    dL = jnp.where(i > j, -dots.nt(dots.tn(T, dT), T), 0.0)
    gq = jnp.sum(jnp.where(i == j, dP_ref[...], 0.0), axis=1)[:, None]  # P's diagonal
    # sweep 2: the grams' pullback, Q' = Q ⊙ Γ, K̃' = K̃ ⊙ Γ_C/Γ, Γ_C (T and G_Q read again per
    # tile rather than held across it: fewer live [C, C] tiles, fewer spills)
    for cols, ls in zip(key_tiles, sizes):
        q, k, kw, g = _tile((q_ref, k_ref, kw_ref, g_ref), cols)
        GQ = jnp.where(i >= j, dP_ref[...], 0.0)
        Z, dqP, dkwAP = _grams_vjp(dL, GQ, q, b * k, kw, g, g_ref, cols, ls, dots)
        db = db + jnp.sum(k * Z, axis=1)
        dkA = b * Z
        dg_grams = k * dkA + q * dqP - kw * dkwAP
        dqP, dkwAP = _add((dqP, dkwAP), _diagonal_vjp(gq, q, kw))
        g_last = g_ref[C - 1, cols].astype(f32)
        Gam = jnp.exp(g)
        dKg = dots.tn(T_ref[...], dW_ref[:, cols])
        wk = Gam * k * dKg
        dqd, dkwt = dqd_ref[:, cols], dkwt_ref[:, cols]
        tail = jnp.exp(g_last[None, :] - g)
        dk_ref[:, cols] = (dkA + b * Gam * dKg).astype(dk_ref.dtype)
        dq_ref[:, cols] = (dqP + dqd * Gam).astype(dq_ref.dtype)
        dkw_ref[:, cols] = (dkwAP + dkwt * tail).astype(dkw_ref.dtype)
        at_last = _row_ids(C, k.shape[1]) == C - 1
        dg_ref[:, cols] = (dg_grams + b * wk + dqd * q * Gam
                           + jnp.where(at_last, (jnp.exp(g_last) * dgc_ref[cols])[None, :], 0.0))
        ds_ref[:, cols] = dkwt * kw * tail  # K̃' = K̃ ⊙ exp σ
    db_ref[...] = db.astype(db_ref.dtype)


def wy_vector_fwd(q, k, kw, v, beta, gamma, *, chunk, block_v, dots: Dots, num_warps,
                  num_stages, block_k=64, out_dtype=jnp.float32, factored_blocks=True,
                  bound=FORWARD_BOUND):
    """``wy_triton.wy_fwd`` for a per-channel decay, gamma [B, Tp, H, K] (the in-chunk cumsum):
    W, U, K̃', Q' [B, H, Tp, ·], P [B, H, Tp, C] (in ``out_dtype``) and Γ_C [B, H, NC, K], equal to
    ``delta_rule.prepare``'s outputs (module docstring), and T [B, H, Tp, C] for the pullback;
    ``block_k``: key columns per tile (the grams are sums over key tiles); ``factored_blocks``
    False: every tile by halving down to single rows (an ablation: exact, slower where a tile's
    blocks could factor); ``bound``: how far from its middle row a block's γ may spread and
    still factor (module docstring)."""
    in_specs, wy_specs, grid = layout(q, v, gamma, chunk, vector=True, name="gamma")
    args = [q, k, kw, v, beta, gamma]
    kernel = functools.partial(_fwd_kernel, dots=dots, block_v=block_v, block_k=block_k,
                               factored_blocks=factored_blocks, bound=bound)
    return call(kernel, "wy_vector_fwd", grid, in_specs, wy_specs,
                wy_shapes(q, v, grid, chunk, args, out_dtype), args, dots, num_warps, num_stages)


def wy_vector_bwd(q, k, kw, v, beta, gamma, T, dW, dU, dkw_t, dq_dec, dP, dgc, *, chunk,
                  block_v, dots: Dots, num_warps, num_stages, block_k=64, factored_blocks=True,
                  bound=PULLBACK_BOUND):
    """Cotangents of q, k, kw [B, Tp, H, K], v [B, Tp, H, V], beta [B, Tp, H] (each in its
    input's dtype, rounded once from the float32 sums), gamma and σ = γ_C − γ [B, Tp, H, K]
    (float32) from those of ``wy_vector_fwd``'s outputs and its T
    (module docstring); ``block_k``: key columns per tile; ``factored_blocks`` and ``bound`` as
    ``wy_vector_fwd``'s (its own path, whatever the forward's was)."""
    in_specs, wy_specs, grid = layout(q, v, gamma, chunk, vector=True, name="gamma")
    args = [q, k, kw, v, beta, gamma]
    cts = [T, dW, dU, dkw_t, dq_dec, dP, dgc]
    out_shape = [out_struct(x.shape, x.dtype, *args, *cts) for x in args]
    out_shape.append(out_struct(gamma.shape, f32, *args, *cts))  # σ as γ
    kernel = functools.partial(_bwd_kernel, dots=dots, block_v=block_v, block_k=block_k,
                               factored_blocks=factored_blocks, bound=bound)
    return call(kernel, "wy_vector_bwd", grid, in_specs + wy_specs[-1:] + wy_specs[:-1],
                in_specs + in_specs[-1:], out_shape, args + cts, dots, num_warps, num_stages)
