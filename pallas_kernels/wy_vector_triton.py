"""Per-chunk WY tensors of the delta core with a per-channel (KDA) decay and their pullback,
Pallas Triton lowering: ``wy_triton``'s grid, layout and formulas with γ [C, K] per channel.

In a chunk (γ the cumulative log decay from the chunk start per channel, non-increasing down the
rows, Γ = exp γ, e_ij = exp(γ_i − γ_j) [K]):

    A_ij = Σ_k k_ik k̃_jk e_ijk    P_ij = Σ_k q_ik k̃_jk e_ijk    (i >= j, else 0)
    L = strict_tril(Diag(β) A)    T = (I + L)^-1                  (doubling product)
    W = T Diag(β)(K ⊙ Γ)    U = T Diag(β) V    K̃' = K̃ ⊙ Γ_C/Γ    Q' = Q ⊙ Γ    Γ_C = exp γ_C [K]

exp(γ_i − γ_j) overflows over a whole chunk for i < j, so the grams are formed by 16-row blocks
as ``gram.decayed_gram`` does: for blocks I > J, r the first row of I,
A[I, J] = (K_I ⊙ exp(γ_I − γ_r))(K̃_J ⊙ exp(γ_r − γ_J))ᵀ (both exponents <= 0; one masked [C, C]
dot per block I). The blocks I = J: where every |γ_i − γ_m(i)| <= DIAG_BOUND in a key tile (m(i)
= 16⌊i/16⌋ + 8, the middle row of i's block), all four at once by one more masked dot,
(K ⊙ exp(γ − γ_m))(K̃ ⊙ exp(γ_m − γ))ᵀ (every factor and product of two finite); else summed
over 16 steps, step t adding the column c(i) = 16⌊i/16⌋ + t of every row i >= c(i) (its k̃ and
γ rows loaded from the refs). Before both: where every |γ_i − γ_{C/2}| <= DIAG_BOUND in the key
tile (a chunk that decays by at most ~40 per channel), the whole gram is one factored dot
through the chunk's middle row, as with a scalar decay. ``lax.cond`` per key tile chooses; the
pullback makes the same choices.

Pullback (cotangents dW, dU, dK̃', dQ', dP, dΓ_C [K]): with dT, dL as in ``wy_triton``,
G_K = Diag(β) dL, G_Q = tril(dP) and the grams' pullback through the same blocks,

    dK_A = Σ_j G_K,ij k̃_j ⊙ e_ij    dQ_P = Σ_j G_Q,ij k̃_j ⊙ e_ij
    dK̃_AP = Σ_i (G_K,ij k_i + G_Q,ij q_i) ⊙ e_ij
    dK = dK_A + Diag(β) Γ ⊙ Tᵀ dW    dQ = dQ_P + dQ' ⊙ Γ    dK̃ = dK̃_AP + dK̃' ⊙ Γ_C/Γ
    dV = Diag(β) Tᵀ dU    dβ = rowsum(dL ⊙ A) + rowsum(Γ ⊙ K ⊙ Tᵀ dW) + rowsum(Tᵀ dU ⊙ V)
    dγ = K ⊙ dK_A + Q ⊙ dQ_P − K̃ ⊙ dK̃_AP + Diag(β) Γ ⊙ K ⊙ Tᵀ dW + dQ' ⊙ Q' − dK̃' ⊙ K̃'
         + δ_{i,C−1} (colsum(dK̃' ⊙ K̃') + Γ_C ⊙ dΓ_C)

(A and P depend on γ only through γ_i − γ_j, so their part of dγ is the first three terms; the
blocks' reference rows get none.) This is the exact pullback of ``delta_rule.prepare``.
"""

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.triton_common import Dots, iota2, out_struct, unit_lower_inverse
from pallas_kernels.wy_triton import call, layout, tiles, u_bwd, u_fwd, wy_shapes
from precond_linattn.chunked.gram import SUB_BLOCK as SUB

f32 = jnp.float32
DIAG_BOUND = 20.0  # |γ_i − γ_ref| up to which a gram factors through row ref (products <= e^40)


def _row_ids(C, K):
    """Row index of each entry of a [C, K] tile."""
    return lax.broadcasted_iota(jnp.int32, (C, K), 0)


def _off_blocks(g, g_ref, cols):
    """For each 16-row block I >= 1 (r = 16 I): (ex, ey, M) with ex = exp(γ − γ_r) on rows >= r,
    ey = exp(γ_r − γ) on rows < r (0 elsewhere) [C, BK] for the key columns ``cols`` (g = γ
    there), and M [C, C] the entries (i in I, j < r), those of the gram blocks below the diagonal
    that (X ⊙ ex)(Y ⊙ ey)ᵀ gives."""
    C, BK = g.shape
    row = _row_ids(C, BK)
    i, j = iota2(C)
    for blk in range(1, C // SUB):
        r = blk * SUB
        gr = g_ref[r, cols].astype(f32)[None, :]
        ex = jnp.exp(jnp.where(row >= r, g - gr, -jnp.inf))
        ey = jnp.exp(jnp.where(row < r, gr - g, -jnp.inf))
        yield ex, ey, (i // SUB == blk) & (j < r)


def _block_rows(t, refs, cols, C):
    """For each ref, the [C, BK] tile of its key columns ``cols`` whose row i is the ref's row
    16⌊i/16⌋ + t (row t of i's 16-row block), float32."""
    out = []
    for ref in refs:
        x = None
        for blk in range(C // SUB):
            r = ref[blk * SUB + t, cols].astype(f32)[None, :]
            x = r if x is None else jnp.where(_row_ids(C, r.shape[1]) // SUB == blk, r, x)
        out.append(x)
    return out


def _diag_step(t, g, g_ref, kw_ref, cols):
    """Step t of the diagonal blocks, key columns ``cols``: (k̃_c, γ_c, e, sel) with k̃_c, γ_c
    [C, BK] row i = k̃, γ of row c(i) = 16⌊i/16⌋ + t, e = exp(γ_i − γ_c(i)) for i >= c(i) (0 else),
    sel [C, C] the entries (i, c(i))."""
    C, BK = g.shape
    kc, gc = _block_rows(t, (kw_ref, g_ref), cols, C)
    e = jnp.exp(jnp.where(_row_ids(C, BK) % SUB >= t, g - gc, -jnp.inf))
    i, j = iota2(C)
    return kc, gc, e, j == (i // SUB) * SUB + t


def _tile(refs, cols):
    """The key columns ``cols`` of each ref, float32 [C, BK]."""
    return [r[:, cols].astype(f32) for r in refs]


def _diag_blocks(g, g_ref, cols):
    """(x, M): x = γ − γ_m(i) [C, BK] for the key columns ``cols`` (g = γ there; m(i) = 16⌊i/16⌋
    + 8) and M [C, C] the entries of the diagonal blocks on and below the diagonal."""
    C = g.shape[0]
    (gm,) = _block_rows(SUB // 2, (g_ref,), cols, C)
    i, j = iota2(C)
    return g - gm, (i // SUB == j // SUB) & (i >= j)


def _factorable(x):
    """Whether every |x| <= DIAG_BOUND (reduced one axis at a time, as the lowering takes it)."""
    return jnp.max(jnp.max(jnp.abs(x), axis=1)) <= DIAG_BOUND


def _gram_blocks(grams, rows, kw, ex, ey, M, dots):
    """grams + the entries M of (Z ⊙ ex)(K̃ ⊙ ey)ᵀ for each left factor Z in ``rows``."""
    Y = kw * ey
    return tuple(X + jnp.where(M, dots.nt(Z * ex, Y), 0.0) for X, Z in zip(grams, rows))


def _tile_grams(grams, rows, kw, g, g_ref, kw_ref, cols, dots):
    """grams + one key tile's share (``_grams``): the whole chunk by one factored dot through its
    middle row where the tile allows (``_factorable``), else the 16-row blocks."""
    C = g.shape[0]
    x = g - g_ref[C // 2, cols].astype(f32)[None, :]
    i, j = iota2(C)

    def whole(grams):
        return _gram_blocks(grams, rows, kw, jnp.exp(x), jnp.exp(-x), i >= j, dots)

    def blocked(grams):
        for ex, ey, M in _off_blocks(g, g_ref, cols):
            grams = _gram_blocks(grams, rows, kw, ex, ey, M, dots)
        xd, Md = _diag_blocks(g, g_ref, cols)

        def factored(grams):
            return _gram_blocks(grams, rows, kw, jnp.exp(xd), jnp.exp(-xd), Md, dots)

        def looped(grams):
            def step(t, grams):
                kc, _, e, sel = _diag_step(t, g, g_ref, kw_ref, cols)
                F = kc * e
                return tuple(X + jnp.where(sel, jnp.sum(Z * F, axis=1)[:, None], 0.0)
                             for X, Z in zip(grams, rows))

            return lax.fori_loop(0, SUB, step, grams)

        return lax.cond(_factorable(xd), factored, looped, grams)

    return lax.cond(_factorable(x), whole, blocked, grams)


def _grams(q_ref, k_ref, kw_ref, g_ref, dots, key_tiles, with_p=True):
    """(A, P) [C, C] (module docstring; zero above the diagonal), summed over the key tiles;
    without ``with_p`` only (A,)."""
    C = k_ref.shape[0]
    grams = (jnp.zeros((C, C), f32),) * (2 if with_p else 1)
    for cols in key_tiles:
        q, k, kw, g = _tile((q_ref, k_ref, kw_ref, g_ref), cols)
        grams = _tile_grams(grams, (k, q)[:len(grams)], kw, g, g_ref, kw_ref, cols, dots)
    return grams


def _blocks_vjp(GK, GQ, M, q, k, kw, ex, ey, dots):
    """The pullback of ``_gram_blocks``'s entries M along (G_K, G_Q): (dK, dQ, dK̃) [C, BK]."""
    GKm, GQm = jnp.where(M, GK, 0.0), jnp.where(M, GQ, 0.0)
    Y = kw * ey
    return (dots.nn(GKm, Y) * ex, dots.nn(GQm, Y) * ex,
            (dots.tn(GKm, k * ex) + dots.tn(GQm, q * ex)) * ey)


def _grams_vjp(GK, GQ, q, k, kw, g, refs, cols, dots):
    """(dK_A, dQ_P, dK̃_AP) [C, BK] for the key columns ``cols`` (q, k, kw, g their tiles; refs =
    (q_ref, k_ref, kw_ref, g_ref)): the pullback of (A, P) = ``_grams`` along (G_K, G_Q) in K, Q
    and K̃ (module docstring), by the same choices as there. Looped, step t adds to row i of dK,
    dQ the terms of column c(i) and to row j of dK̃ those of row c(j) (both 16⌊·/16⌋ + t),
    reading G at (c(j), j) from Gᵀ: every reduction runs along a row."""
    q_ref, k_ref, kw_ref, g_ref = refs
    C, BK = k.shape
    x = g - g_ref[C // 2, cols].astype(f32)[None, :]
    i, j = iota2(C)

    def whole():
        return _blocks_vjp(GK, GQ, i >= j, q, k, kw, jnp.exp(x), jnp.exp(-x), dots)

    def blocked():
        acc = (jnp.zeros((C, BK), f32),) * 3
        for ex, ey, M in _off_blocks(g, g_ref, cols):
            acc = _add(acc, _blocks_vjp(GK, GQ, M, q, k, kw, ex, ey, dots))
        xd, Md = _diag_blocks(g, g_ref, cols)

        def factored(acc):
            return _add(acc, _blocks_vjp(GK, GQ, Md, q, k, kw, jnp.exp(xd), jnp.exp(-xd), dots))

        def looped(acc):
            GKt, GQt = GK.T, GQ.T
            row = _row_ids(C, BK)

            def step(t, acc):
                dk, dq, dkw = acc
                kc, gc, e, sel = _diag_step(t, g, g_ref, kw_ref, cols)
                gk = jnp.sum(jnp.where(sel, GK, 0.0), axis=1)[:, None]  # G[i, c(i)]
                gq = jnp.sum(jnp.where(sel, GQ, 0.0), axis=1)[:, None]
                gkt = jnp.sum(jnp.where(sel, GKt, 0.0), axis=1)[:, None]  # G[c(j), j]
                gqt = jnp.sum(jnp.where(sel, GQt, 0.0), axis=1)[:, None]
                kr, qr = _block_rows(t, (k_ref, q_ref), cols, C)
                et = jnp.exp(jnp.where(row % SUB <= t, gc - g, -jnp.inf))  # exp(γ_c(j) − γ_j)
                return dk + gk * kc * e, dq + gq * kc * e, dkw + (gkt * kr + gqt * qr) * et

            return lax.fori_loop(0, SUB, step, acc)

        return lax.cond(_factorable(xd), factored, looped, acc)

    return lax.cond(_factorable(x), whole, blocked)


def _add(xs, ys):
    return tuple(x + y for x, y in zip(xs, ys))


def _fwd_kernel(q_ref, k_ref, kw_ref, v_ref, beta_ref, g_ref, W_ref, U_ref, kwt_ref, qd_ref,
                P_ref, gc_ref, T_ref, *, dots, block_v, block_k):
    """One chunk's W, U, K̃', Q', P, Γ_C and T (module docstring), by key tiles of ``block_k``."""
    C, K = k_ref.shape
    key_tiles = tiles(K, block_k)
    A, P = _grams(q_ref, k_ref, kw_ref, g_ref, dots, key_tiles)
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
                dqd_ref, dP_ref, dgc_ref, dq_ref, dk_ref, dkw_ref, dv_ref, db_ref, dg_ref, *, dots,
                block_v, block_k):
    """One chunk's dQ, dK, dK̃, dV, dβ and dγ (module docstring), T read from the forward, in two
    sweeps over key tiles of ``block_k`` (dT and dβ first; then, after dL, each tile's
    cotangents, Tᵀ dW recomputed per tile)."""
    C, K = k_ref.shape
    key_tiles = tiles(K, block_k)
    (A,) = _grams(q_ref, k_ref, kw_ref, g_ref, dots, key_tiles, with_p=False)
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
    db_ref[...] = db + jnp.sum(dL * A, axis=1)
    GK, GQ = b * dL, jnp.where(i >= j, dP_ref[...], 0.0)
    # sweep 2: the grams' pullback, Q' = Q ⊙ Γ, K̃' = K̃ ⊙ Γ_C/Γ, Γ_C
    for cols in key_tiles:
        q, k, kw, g = _tile((q_ref, k_ref, kw_ref, g_ref), cols)
        dkA, dqP, dkwAP = _grams_vjp(GK, GQ, q, k, kw, g, (q_ref, k_ref, kw_ref, g_ref), cols,
                                     dots)
        g_last = g_ref[C - 1, cols].astype(f32)
        Gam = jnp.exp(g)
        dKg = dots.tn(T, dW_ref[:, cols])
        wk = Gam * k * dKg
        dqd, dkwt = dqd_ref[:, cols], dkwt_ref[:, cols]
        tail = jnp.exp(g_last[None, :] - g)
        dk_ref[:, cols] = dkA + b * Gam * dKg
        dq_ref[:, cols] = dqP + dqd * Gam
        dkw_ref[:, cols] = dkwAP + dkwt * tail
        e = dkwt * kw * tail
        last = jnp.sum(e, axis=0) + jnp.exp(g_last) * dgc_ref[cols]
        dg_ref[:, cols] = (k * dkA + q * dqP - kw * dkwAP + b * wk + dqd * q * Gam - e
                           + jnp.where(_row_ids(C, k.shape[1]) == C - 1, last[None, :], 0.0))


def wy_vector_fwd(q, k, kw, v, beta, gamma, *, chunk, block_v, dots: Dots, num_warps,
                  num_stages, block_k=64, out_dtype=jnp.float32):
    """``wy_triton.wy_fwd`` for a per-channel decay, gamma [B, Tp, H, K] (the in-chunk cumsum):
    W, U, K̃', Q' [B, H, Tp, ·], P [B, H, Tp, C] (in ``out_dtype``) and Γ_C [B, H, NC, K], equal to
    ``delta_rule.prepare``'s outputs (module docstring), and T [B, H, Tp, C] for the pullback;
    ``block_k``: key columns per tile (the grams are sums over key tiles)."""
    in_specs, wy_specs, grid = layout(q, v, gamma, chunk, vector=True)
    args = [q, k, kw, v, beta, gamma]
    kernel = functools.partial(_fwd_kernel, dots=dots, block_v=block_v, block_k=block_k)
    return call(kernel, "wy_vector_fwd", grid, in_specs, wy_specs,
                wy_shapes(q, v, grid, chunk, args, out_dtype), args, dots, num_warps, num_stages)


def wy_vector_bwd(q, k, kw, v, beta, gamma, T, dW, dU, dkw_t, dq_dec, dP, dgc, *, chunk,
                  block_v, dots: Dots, num_warps, num_stages, block_k=64):
    """Cotangents of q, k, kw [B, Tp, H, K], v [B, Tp, H, V], beta [B, Tp, H] and gamma
    [B, Tp, H, K] (float32) from those of ``wy_vector_fwd``'s outputs and its T (module
    docstring); ``block_k``: key columns per tile."""
    in_specs, wy_specs, grid = layout(q, v, gamma, chunk, vector=True)
    args = [q, k, kw, v, beta, gamma]
    cts = [T, dW, dU, dkw_t, dq_dec, dP, dgc]
    out_shape = [out_struct(x.shape, f32, *args, *cts) for x in args]
    kernel = functools.partial(_bwd_kernel, dots=dots, block_v=block_v, block_k=block_k)
    return call(kernel, "wy_vector_bwd", grid, in_specs + wy_specs[-1:] + wy_specs[:-1],
                in_specs, out_shape, args + cts, dots, num_warps, num_stages)
