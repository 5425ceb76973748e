"""Per-chunk WY tensors of the delta core (SPEC 2.1) and their pullback, Pallas Triton lowering.

One program per (batch row, head, chunk): grid B × H × NC, nothing carried between chunks. In a
chunk (rows i, j = 0 .. C − 1; g the per-token log decays, γ_i = Σ_{t<=i} g_t the cumulative
log decay from the chunk start, 0 without decay, Γ = exp γ; D_ij = Γ_i/Γ_j for i ≥ j, else 0;
A = K K̃ᵀ ⊙ D):

    L = strict_tril(Diag(β) A)    P = tril(Q K̃ᵀ ⊙ D)    T = (I + L)^-1     (block merges)
    W = T Diag(β)(K ⊙ Γ)    U = T Diag(β) V    K̃' = K̃ ⊙ exp σ    Q' = Q ⊙ Γ    Γ_C = exp γ_C

with σ_i = Σ_{t>i} g_t (``chunked.delta.suffix_sums``: γ_C − γ without the difference). The
kernels take g and form γ (a cumsum), σ and γ_C in the chunk (σ a masked sum over [C, C] of
only its own terms), and the pullback returns dg_t = Σ_{i>=t} dγ_i + Σ_{i<t} dσ_i the same way: no
XLA glue around them (the cumsums and their transposes in XLA cost 0.07-0.11 ms, RESULTS runs
56-57).

``wy_fwd`` writes ``delta_rule.prepare``'s outputs and T. ``wy_bwd`` reads T back (a
[C, C] tile per chunk: cheaper than the inverse's chain of matmuls) and, with a decay,
the forward's P (for E below: no Q K̃ᵀ recomputed, one [C, C] accumulator fewer), recomputes A
(one matmul) and applies the pullback to the cotangents (dW, dU, dK̃', dQ', dP, dΓ_C; dΓ_C is
broadcast over K, so its channels are summed):

    dT = dW (Diag(β) K⊙Γ)ᵀ + dU (Diag(β) V)ᵀ        dL = strict_tril(−Tᵀ dT Tᵀ)
    G_K = Diag(β) dL ⊙ D                            G_Q = tril(dP) ⊙ D
    dK  = G_K K̃ + Diag(βΓ) Tᵀ dW                    dV  = Diag(β) Tᵀ dU
    dK̃  = G_Kᵀ K + G_Qᵀ Q + dK̃' ⊙ Γ_C/Γ              dQ  = G_Q K̃ + dQ' ⊙ Γ
    dβ  = rowsum(dL ⊙ A) + Γ rowsum(Tᵀ dW ⊙ K) + rowsum(Tᵀ dU ⊙ V)
    dγ  = rowsum(E) − colsum(E) + βΓ rowsum(Tᵀ dW ⊙ K) + rowsum(dQ' ⊙ Q') + δ_{i,C−1} Γ_C Σ dΓ_C
    dσ  = rowsum(dK̃' ⊙ K̃'),     E = dL ⊙ L + dP ⊙ P

The block merges (``triton_common.unit_lower_inverse``) equal (I + L)^-1 on every strictly
lower-triangular L, so along strictly lower-triangular directions their derivative is that of
the inverse, −T dL T: the formulas above are the exact pullback of ``prepare``. In dγ the
diagonal of E (P_ii has no γ) cancels exactly and is left out rather than formed: with strong
decays dγ is a small fraction of those terms, and their rounding would be all of it (the same
holds for K̃' through σ: as γ_C − γ its pullback, −dσ on each row and Σ dσ on the last,
cancelled on a padded chunk's last real row). Value columns are processed in tiles of
``block_v`` inside the program (registers); everything else is held whole ([C, K], [C, C]).
Inputs are in the kernels' layout (q, k, kw [B, Tp, H, K], v [B, Tp, H, V], beta, g [B, Tp,
H]), any float dtype; math and outputs are float32.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.triton_common import Dots, iota2, out_struct, unit_lower_inverse


def in_chunk_sums(g):
    """(γ, σ, γ_C) of one chunk's log decays g [C]: the cumsum γ_i = Σ_{t<=i} g_t (as
    ``chunked.delta.decay_sums``), σ_i = Σ_{t>i} g_t (a masked sum of only its own terms) and
    γ_C = γ_{C-1} (so that σ_{C-1} = 0 and γ_C agree with the cumsum's last row)."""
    i, t = iota2(g.shape[0])
    gam = jnp.cumsum(g)
    last = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, g.shape, 0) == g.shape[0] - 1, gam, 0.0))
    terms = jnp.broadcast_to(g[None, :], (g.shape[0],) * 2)
    return gam, jnp.sum(jnp.where(t > i, terms, 0.0), axis=1), last


def to_log_decays(dgamma, dsigma):
    """dg_t = Σ_{i>=t} dγ_i + Σ_{i<t} dσ_i [C]: the pullback of ``in_chunk_sums``' γ and σ
    (each dg_t a sum of only its own terms)."""
    t, i = iota2(dgamma.shape[0])
    return jnp.sum(jnp.where(i >= t, dgamma[None, :], dsigma[None, :]), axis=1)


def _decayed_gram(gram, beta, g_ref, C):
    """(β, Γ, Γ_C/Γ = exp σ [C], Γ_C, D, A, L [C, C]) of one chunk from ``gram`` = K K̃ᵀ [C, C]
    and its log decays (``g_ref``; None: no decay)."""
    f32 = jnp.float32
    i, j = iota2(C)
    if g_ref is None:
        gam, sig, g_last = jnp.zeros((C,), f32), jnp.zeros((C,), f32), jnp.float32(0.0)
    else:
        gam, sig, g_last = in_chunk_sums(g_ref[...].astype(f32))
    D = jnp.exp(jnp.where(i >= j, gam[:, None] - gam[None, :], -jnp.inf))
    A = gram * D
    L = jnp.where(i > j, beta[:, None] * A, 0.0)
    return beta, jnp.exp(gam), jnp.exp(sig), jnp.exp(g_last), D, A, L


def tiles(n, block):
    """Static column slices of width min(block, n) covering n columns."""
    width = min(block, n)
    return [pl.ds(t * width, width) for t in range(n // width)]


def u_fwd(T, b, v_ref, U_ref, dots, block_v):
    """U = T Diag(β) V, by value tiles (b = β[:, None])."""
    for cols in tiles(v_ref.shape[-1], block_v):
        U_ref[:, cols] = dots.nn(T, b * v_ref[:, cols].astype(jnp.float32)).astype(U_ref.dtype)


def u_bwd(T, b, v_ref, dU_ref, dv_ref, dots, block_v):
    """The pullback of U = T Diag(β) V by value tiles: writes dV = Diag(β) Tᵀ dU and returns
    (dU (Diag(β) V)ᵀ, rowsum(Tᵀ dU ⊙ V)), U's parts of dT and dβ."""
    dT = db = 0.0
    for cols in tiles(v_ref.shape[-1], block_v):
        v, dU = v_ref[:, cols].astype(jnp.float32), dU_ref[:, cols]
        dT = dT + dots.nt(dU, b * v)
        dVb = dots.tn(T, dU)
        dv_ref[:, cols] = (b * dVb).astype(dv_ref.dtype)
        db = db + jnp.sum(dVb * v, axis=1)
    return dT, db


def _inverse(q_ref, k_ref, kw_ref, beta_ref, g_ref, P_ref, gc_ref, dots, block_k):
    """One chunk's P and Γ_C (stored), its T = (I + L)^-1 and (β, Γ, Γ_C/Γ) [C] (returned)."""
    C, K = k_ref.shape
    key_tiles = tiles(K, block_k)
    gram = sum(dots.nt(k_ref[:, cols], kw_ref[:, cols]) for cols in key_tiles)
    beta, Gam, tail, gc, D, _, L = _decayed_gram(gram, beta_ref[...].astype(jnp.float32), g_ref, C)
    P = sum(dots.nt(q_ref[:, cols], kw_ref[:, cols]) for cols in key_tiles) * D
    P_ref[...] = P.astype(P_ref.dtype)
    gc_ref[...] = jnp.full((K,), gc, jnp.float32)
    return unit_lower_inverse(L, dots), (beta, Gam, tail)


def _apply(T, vecs, q_ref, k_ref, kw_ref, v_ref, W_ref, U_ref, kwt_ref, qd_ref, dots, block_v,
           block_k):
    """One chunk's W, U, K̃', Q' from T and ``vecs`` = (β, Γ, Γ_C/Γ), the [C, K] tensors by key
    tiles of ``block_k``; ``dots``: those of W and U."""
    f32 = jnp.float32
    b, Gcol, tcol = (x[:, None] for x in vecs)
    u_fwd(T, b, v_ref, U_ref, dots, block_v)
    for cols in tiles(k_ref.shape[-1], block_k):
        W_ref[:, cols] = dots.nn(T, b * Gcol * k_ref[:, cols].astype(f32)).astype(W_ref.dtype)
        kwt_ref[:, cols] = (kw_ref[:, cols].astype(f32) * tcol).astype(kwt_ref.dtype)
        qd_ref[:, cols] = (q_ref[:, cols].astype(f32) * Gcol).astype(qd_ref.dtype)


def _fwd_kernel(*refs, dots, apply_dots, block_v, block_k, has_decay):
    """One chunk's W, U, K̃', Q', P, Γ_C and T (module docstring); ``apply_dots``: W's and U's."""
    q_ref, k_ref, kw_ref, v_ref, beta_ref, *refs = refs
    g_ref = refs.pop(0) if has_decay else None
    W_ref, U_ref, kwt_ref, qd_ref, P_ref, gc_ref, T_ref = refs
    T, vecs = _inverse(q_ref, k_ref, kw_ref, beta_ref, g_ref, P_ref, gc_ref, dots, block_k)
    T_ref[...] = T.astype(T_ref.dtype)
    _apply(T, vecs, q_ref, k_ref, kw_ref, v_ref, W_ref, U_ref, kwt_ref, qd_ref, apply_dots,
           block_v, block_k)


def _inverse_kernel(*refs, dots, block_k, has_decay):
    """``wy_inverse``'s kernel: one chunk's T, P, Γ_C and rows β, βΓ, Γ, Γ_C/Γ."""
    q_ref, k_ref, kw_ref, beta_ref, *refs = refs
    g_ref = refs.pop(0) if has_decay else None
    P_ref, gc_ref, T_ref, vec_ref = refs
    T, (beta, Gam, tail) = _inverse(q_ref, k_ref, kw_ref, beta_ref, g_ref, P_ref, gc_ref, dots,
                                    block_k)
    T_ref[...] = T.astype(T_ref.dtype)
    for row, x in enumerate((beta, beta * Gam, Gam, tail)):
        vec_ref[row, :] = x


def _bwd_kernel(*refs, dots, block_v, block_k, has_decay):
    """One chunk's dQ, dK, dK̃, dV, dβ and dg (from dγ and dσ, module docstring) in two sweeps over tiles of
    ``block_k`` key columns (few [C, K] values live at once): the first forms dT (with the value
    tiles) and the rowsums; the second, after dL, writes dK, dK̃, dQ tile by tile (Tᵀ dW is
    recomputed per tile rather than kept)."""
    q_ref, k_ref, kw_ref, v_ref, beta_ref, *refs = refs
    g_ref = refs.pop(0) if has_decay else None
    T_ref = refs.pop(0)
    P_ref = refs.pop(0) if has_decay else None
    (dW_ref, dU_ref, dkwt_ref, dqd_ref, dP_ref, dgc_ref, dq_ref, dk_ref, dkw_ref, dv_ref,
     db_ref) = refs[:11]
    dg_ref = refs[11] if has_decay else None
    C, K = k_ref.shape
    f32 = jnp.float32
    i, j = iota2(C)
    key_tiles = tiles(K, block_k)
    gram = sum(dots.nt(k_ref[:, cols], kw_ref[:, cols]) for cols in key_tiles)
    beta, Gam, tail, gc, D, A, _ = _decayed_gram(gram, beta_ref[...].astype(f32), g_ref, C)
    T = T_ref[...]
    b, Gcol, tcol = beta[:, None], Gam[:, None], tail[:, None]

    # sweep 1: dT and dβ from W = T Diag(βΓ) K and U = T Diag(β) V (which also writes dV)
    dT, db = u_bwd(T, b, v_ref, dU_ref, dv_ref, dots, block_v)
    s = 0.0  # Γ rowsum(Tᵀ dW ⊙ K)
    for cols in key_tiles:
        k, dW = k_ref[:, cols].astype(f32), dW_ref[:, cols]
        s = s + Gam * jnp.sum(dots.tn(T, dW) * k, axis=1)
        dT = dT + dots.nt(dW, b * Gcol * k)
    # T = (I + L)^-1, L = strict_tril(Diag(β) A);  P = tril(Q K̃ᵀ ⊙ D)
    dL = jnp.where(i > j, -dots.nt(dots.tn(T, dT), T), 0.0)
    db_ref[...] = (db + s + jnp.sum(dL * A, axis=1)).astype(db_ref.dtype)
    GK = b * dL * D
    dP = jnp.where(i >= j, dP_ref[...], 0.0)
    GQ = dP * D

    # sweep 2: dK = G_K K̃ + Diag(βΓ) Tᵀ dW, dK̃ = G_Kᵀ K + G_Qᵀ Q + dK̃' ⊙ Γ_C/Γ, dQ = G_Q K̃ + dQ' ⊙ Γ
    e = qd = 0.0  # rowsum(dK̃' ⊙ K̃'), rowsum(dQ' ⊙ Q')
    for cols in key_tiles:
        k, kw, q = k_ref[:, cols], kw_ref[:, cols], q_ref[:, cols]
        dk_ref[:, cols] = (b * Gcol * dots.tn(T, dW_ref[:, cols])
                           + dots.nn(GK, kw)).astype(dk_ref.dtype)
        dkwt = dkwt_ref[:, cols]
        dkw_ref[:, cols] = (dots.tn(GK, k) + dots.tn(GQ, q) + dkwt * tcol).astype(dkw_ref.dtype)
        dqd = dqd_ref[:, cols]
        dq_ref[:, cols] = (dots.nn(GQ, kw) + dqd * Gcol).astype(dq_ref.dtype)
        if has_decay:
            e = e + tail * jnp.sum(dkwt * kw.astype(f32), axis=1)
            qd = qd + Gam * jnp.sum(dqd * q.astype(f32), axis=1)
    if has_decay:  # γ enters through D, Γ and Γ_C, σ through Γ_C/Γ; dL ⊙ L = β dL ⊙ A
        # the diagonal of E cancels exactly: left out, not formed
        E = b * dL * A + jnp.where(i > j, dP * P_ref[...].astype(f32), 0.0)
        at_last = lax.broadcasted_iota(jnp.int32, (C,), 0) == C - 1
        dgamma = (beta * s + jnp.sum(E, axis=1) - jnp.sum(E, axis=0) + qd
                  + jnp.where(at_last, gc * jnp.sum(dgc_ref[...]), 0.0))
        dg_ref[...] = to_log_decays(dgamma, e).astype(dg_ref.dtype)


def layout(q, v, g, chunk, vector=False, name="g"):
    """(the inputs' block specs, the WY tensors' block specs, grid (B, H, NC)): one chunk per
    program. g (the decays, the argument ``name``: the log decays here, their in-chunk cumsum
    for ``wy_vector_triton``): None or [B, Tp, H], or with ``vector`` [B, Tp, H, K]. Raises
    ValueError for another g shape or Tp not a multiple of chunk."""
    B, Tp, H, K = q.shape
    want = (B, Tp, H, K) if vector else (B, Tp, H)
    if (g is None and vector) or (g is not None and g.shape != want):
        raise ValueError(f"{name} must be {'' if vector else 'None or '}{list(want)} (decays "
                         f"{'per channel' if vector else 'none or per head'}), got "
                         f"{None if g is None else g.shape}")
    V = v.shape[-1]
    if Tp % chunk or v.shape[1] != Tp:
        raise ValueError(f"q and v need Tp a multiple of chunk={chunk}, got {q.shape}, {v.shape}")
    tok = lambda *d: pl.BlockSpec((None, chunk, None, *d),  # noqa: E731
                                  lambda b, h, c: (b, c, h) + (0,) * len(d))
    rows = lambda d: pl.BlockSpec((None, None, chunk, d), lambda b, h, c: (b, h, c, 0))  # noqa: E731
    per_chunk = pl.BlockSpec((None, None, None, K), lambda b, h, c: (b, h, c, 0))
    in_specs = [tok(K), tok(K), tok(K), tok(V), tok()]
    if g is not None:
        in_specs.append(tok(K) if vector else tok())
    wy_specs = [rows(K), rows(V), rows(K), rows(K), rows(chunk), per_chunk, rows(chunk)]
    return in_specs, wy_specs, (B, H, Tp // chunk)


def call(kernel, name, grid, in_specs, out_specs, out_shape, args, dots, num_warps, num_stages):
    """``pl.pallas_call`` of ``kernel`` (its static arguments bound) over ``grid``."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name=name,
    )(*args)


def wy_shapes(q, v, grid, chunk, args, dtype=jnp.float32, t_dtype=jnp.float32):
    """``wy_fwd``'s output structs: W, U, K̃', Q' [B, H, Tp, ·], P [B, H, Tp, C] in ``dtype``,
    Γ_C [B, H, NC, K] in float32 and T [B, H, Tp, C] in ``t_dtype``."""
    B, H, nc = grid
    K, V = q.shape[-1], v.shape[-1]
    rows = [out_struct((B, H, nc * chunk, d), dtype, *args) for d in (K, V, K, K, chunk)]
    return rows + [out_struct((B, H, nc, K), jnp.float32, *args),
                   out_struct((B, H, nc * chunk, chunk), t_dtype, *args)]


def wy_inverse(q, k, kw, beta, g, *, chunk, dots: Dots, num_warps, num_stages, block_k=64,
               out_dtype=jnp.float32, t_dtype=jnp.float32):
    """P [B, H, Tp, C] in ``out_dtype``, Γ_C [B, H, NC, K] float32 and T = (I + L)^-1
    [B, H, Tp, C] in ``t_dtype``: ``wy_fwd``'s outputs that are not scaled inputs (module
    docstring), and the scalings' rows β, βΓ, Γ, Γ_C/Γ [B, H, 4, Tp] float32 (Γ = exp γ,
    Γ_C/Γ = exp σ from the in-chunk sums), for the state passes that apply T themselves
    (``state_wy_mosaic``, T in bf16)."""
    v = jax.ShapeDtypeStruct(q.shape[:3] + (16,), q.dtype)  # no values: a shape for ``layout``
    in_specs, wy_specs, grid = layout(q, v, g, chunk)
    args = [x for x in (q, k, kw, beta, g) if x is not None]
    kernel = functools.partial(_inverse_kernel, dots=dots, block_k=block_k,
                               has_decay=g is not None)
    B, H, nc = grid
    shapes = wy_shapes(q, v, grid, chunk, args, out_dtype, t_dtype)[4:]
    shapes.append(out_struct((B, H, 4, nc * chunk), jnp.float32, *args))
    vec_spec = pl.BlockSpec((None, None, 4, chunk), lambda b, h, c: (b, h, 0, c))
    return call(kernel, "wy_inverse", grid, in_specs[:3] + in_specs[4:], wy_specs[4:] + [vec_spec],
                shapes, args, dots, num_warps, num_stages)


def wy_fwd(q, k, kw, v, beta, g, *, chunk, block_v, dots: Dots, num_warps, num_stages,
           block_k=64, out_dtype=jnp.float32, t_dtype=jnp.float32,
           apply_dots: Dots | None = None):
    """W, U, K̃ ⊙ Γ_C/Γ, Q ⊙ Γ [B, H, Tp, ·], P [B, H, Tp, C] (stored in ``out_dtype``) and Γ_C
    [B, H, NC, K] (float32): ``delta_rule.prepare``'s outputs by the same formulas (module
    docstring), and T = (I + L)^-1 [B, H, Tp, C] (in ``t_dtype``: float32 for ``wy_bwd``,
    bfloat16 for ``grads_mosaic``, which reads it as a bf16 wgmma operand). g: the log decays,
    None or [B, Tp, H]; ``block_k``: key columns per tile; ``apply_dots``: the dots of W and U
    (None: ``dots``, which the inverse, the grams and P take). (As two kernels, T first through
    HBM, it was slower: 117 + 127 µs against 235, RESULTS run 78.)"""
    in_specs, wy_specs, grid = layout(q, v, g, chunk)
    args = [x for x in (q, k, kw, v, beta, g) if x is not None]
    shapes = wy_shapes(q, v, grid, chunk, args, out_dtype, t_dtype)
    kernel = functools.partial(_fwd_kernel, dots=dots, apply_dots=apply_dots or dots,
                               block_v=block_v, block_k=block_k, has_decay=g is not None)
    return call(kernel, "wy_fwd", grid, in_specs, wy_specs, shapes, args, dots, num_warps,
                num_stages)


def wy_bwd(q, k, kw, v, beta, g, T, dW, dU, dkw_t, dq_dec, dP, dgc, *, chunk, block_v,
           dots: Dots, num_warps, num_stages, block_k=64, P=None):
    """Cotangents of q, k, kw [B, Tp, H, K], v [B, Tp, H, V], beta [B, Tp, H] and, if given, of
    the log decays g [B, Tp, H] (each in its input's dtype, rounded once from the float32 sums:
    no separate casts; module docstring), from those of ``wy_fwd``'s
    outputs, its T and, with g, its P (module docstring; ValueError without it); ``block_k``:
    the key columns per tile of the kernel's two sweeps."""
    in_specs, wy_specs, grid = layout(q, v, g, chunk)
    if (g is None) != (P is None):
        raise ValueError("wy_bwd takes the forward's P exactly when g is given, got "
                         f"g {'None' if g is None else 'given'}, "
                         f"P {'None' if P is None else 'given'}")
    args = [x for x in (q, k, kw, v, beta, g) if x is not None]
    saved = [T] + ([P] if P is not None else [])  # T's spec is the last, P's the fifth
    saved_specs = wy_specs[-1:] + wy_specs[4:5] * (P is not None)
    cts = [dW, dU, dkw_t, dq_dec, dP, dgc]
    out_shape = [out_struct(x.shape, x.dtype, *args, *saved, *cts) for x in args]
    kernel = functools.partial(_bwd_kernel, dots=dots, block_v=block_v, block_k=block_k,
                               has_decay=g is not None)
    return call(kernel, "wy_bwd", grid, in_specs + saved_specs + wy_specs[:-1], in_specs,
                out_shape, args + saved + cts, dots, num_warps, num_stages)
