"""One Picard sweep of the OSGM d scan (``precond_linattn.chunked.osgm_picard``) and of its
adjoint as Pallas Triton-lowered kernels: the d recurrence for a GIVEN update u_t (the adjoint
for a given coupling), so no reduction is on the per-token chain.

One program per (batch row, head, block of ``block_k`` coordinates) walks the tokens in order:

    d_t = initial[doc] at a document's first token (packed), else the carried d
    a_ref[t] = Σ_{block} d_t ⊙ s_t            (s_t = k_t ⊙ k_t; the block's share of ⟨d_t, s_t⟩)
    d ← clip(r_t d_t + u_t s_t, d_min, d_max)   (one FMA and the clip: the whole chain)

With ``emit`` it also writes k̃_t = d_t ⊙ k_t (or d_t itself with ``emit_d``) and the final d (per
document if ``packed``), as ``osgm_triton.osgm_fwd`` does. The reverse sweep (``osgm_sweep_bwd``)
is the adjoint's, for a GIVEN coupling term c_t = −w_t g_t γ_t (tokens in reverse; Λ the
cotangent of d after token t, m_t the clip's free mask at the forward's d_t):

    Λ = dfinal[doc] at a document's last token, else the carried D
    μ_t = m_t ⊙ Λ;  γ_ref[t] = Σ_{block} μ_t ⊙ s_t
    D = r_t μ_t + c_t s_t + ∂k̃_t ⊙ k_t        (∂L/∂d_t; dinit[doc] = D at its first token)

and with ``emit`` writes every μ_t (the rest of the cotangents are elementwise in XLA).

Over sequence pieces (``osgm_precond``, ``token_pieces``) each sweep first composes each piece's
maps (``osgm_sweep_compose``: x ↦ clip(α x + b, lo, hi), the forward's maps compose into one of
the same form; ``osgm_sweep_compose_bwd``: Λ ↦ M ⊙ Λ + E for the adjoint), so that a chain of p
maps in XLA gives the state entering each piece before the sweep itself runs.

The per-token scalars travel in ``osgm_triton``'s aux rows (a forward sweep's u_t in the β
column; a reverse sweep's c_t there and u_t in column 5; r in RET, the document columns as
there); the token loop (groups of ``unroll`` tokens, rows ``prefetch`` groups ahead) is ``osgm_triton``'s.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.osgm_triton import (
    BETA, DOC, FIRST, LAST, RET, _at_boundary, _aux_columns, _load_aux, _scalars, _store_at,
    _token_loop)
from pallas_kernels.triton_common import out_struct
from precond_linattn.reference.osgm import clip_box

U = BETA  # the aux column that carries u_t in a forward sweep
C, U_BWD = BETA, 5  # a reverse sweep's columns: c_t = −w_t g_t γ_t and u_t


def _kernel(k_ref, aux_ref, init_ref, a_ref, *out, bounds, packed, emit, emit_d, prefetch,
            unroll, scalar_aux):
    """The module docstring's sweep over this program's tokens and coordinates."""
    d_min, d_max = bounds
    out_ref, final_ref = out if emit else (None, None)
    columns = _aux_columns(True, packed)

    def loads(t):
        return k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux)

    def group(t0, rows, d):
        scalars = [_scalars(aux, columns, scalar_aux) for _, aux in rows]
        for i, ((k, _), sc) in enumerate(zip(rows, scalars)):
            if packed:
                doc, d = _at_boundary(sc, FIRST, init_ref, d)
            s = k * k
            a_ref[t0 + i] = jnp.sum(d * s)
            if emit:
                out_ref[t0 + i] = d if emit_d else (d * k).astype(out_ref.dtype)
            d = clip_box(sc[RET] * d + sc[U] * s, d_min, d_max)
            if packed and emit:
                _store_at(sc, LAST, final_ref, doc, d)
        return d

    d0 = jnp.ones(k_ref.shape[-1:], jnp.float32) if packed else init_ref[...]
    d = _token_loop(k_ref.shape[0], False, unroll, prefetch, loads, group, d0)
    if emit and not packed:
        final_ref[...] = d


def _call(kernel, name, args, *, packed, block_k, emit, emit_dtype, num_warps, interpret):
    """``kernel`` over (row, head, block of ``block_k`` coordinates); ``args``: [B, T, H, ·]
    sequences (k first, the aux rows second) and last the [N, H, K] states. Results: the block
    shares [B, H, K / block_k, T] and, with ``emit``, a sequence in ``emit_dtype`` and states."""
    k, aux, state = args[0], args[1], args[-1]
    B, T, H, K = k.shape
    N, bk = state.shape[0], min(block_k, K)
    seq_k = pl.BlockSpec((None, T, None, bk), lambda b, h, j: (b, 0, h, j))
    seq_aux = pl.BlockSpec((None, T, None, aux.shape[-1]), lambda b, h, j: (b, 0, h, 0))
    if packed:
        states = pl.BlockSpec((N, None, bk), lambda b, h, j: (0, h, j))
    else:
        states = pl.BlockSpec((None, None, bk), lambda b, h, j: (b, h, j))
    shares = pl.BlockSpec((None, None, None, T), lambda b, h, j: (b, h, j, 0))
    out_specs, out_shape = [shares], [out_struct((B, H, K // bk, T), jnp.float32, *args)]
    if emit:
        out_specs += [seq_k, states]
        out_shape += [out_struct(k.shape, emit_dtype, *args),
                      out_struct((N, H, K), jnp.float32, *args)]
    return pl.pallas_call(
        kernel, grid=(B, H, K // bk), in_specs=[seq_k, seq_aux] + [seq_k] * (len(args) - 3)
        + [states], out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(*args)


def osgm_sweep(k, aux, initial_state, *, hyper, beta_aware, packed, emit, emit_d, block_k,
               prefetch, num_warps, unroll, scalar_aux, interpret):
    """k [B, T, H, K]; aux [B, T, H, AUX] float32 (u_t in the β column); initial_state [N, H, K]
    float32 (N = B unless ``packed``); hyper (η, d_min, d_max, ε): the bounds are used (η, ε and
    ``beta_aware`` are folded into u). Returns [the block shares of ⟨d_t, s_t⟩ [B, H, K /
    block_k, T] float32] and with ``emit`` also k̃ (k's dtype; every d_t float32 if
    ``emit_d``) and the final d [N, H, K]."""
    del beta_aware
    kernel = functools.partial(_kernel, bounds=hyper[1:3], packed=packed, emit=emit,
                               emit_d=emit_d, prefetch=prefetch, unroll=unroll,
                               scalar_aux=scalar_aux)
    return _call(kernel, "osgm_sweep", (k, aux, initial_state), packed=packed, block_k=block_k,
                 emit=emit, emit_dtype=jnp.float32 if emit_d else k.dtype, num_warps=num_warps,
                 interpret=interpret)


BIG = 1e30  # the identity map's bounds (finite: r = 0 must not meet 0 · inf)


def _compose_kernel(k_ref, aux_ref, b_ref, lo_ref, hi_ref, *, bounds, prefetch, unroll,
                    scalar_aux):
    """This program's tokens composed into the one map they apply (dense rows; ``osgm_sweep``'s
    update, u_t in the β column): after them d is clip(α d_0 + b, lo, hi) with α = Π r_t (formed
    in XLA), from the identity (b, lo, hi) = (0, −BIG, BIG) by, token by token,

        b ← r_t b + u_t s_t    lo ← clip(r_t lo + u_t s_t)    hi ← clip(r_t hi + u_t s_t)."""
    d_min, d_max = bounds
    columns = _aux_columns(True, False)

    def loads(t):
        return k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux)

    def group(t0, rows, carry):
        del t0
        b, lo, hi = carry
        for k, aux in rows:
            sc = _scalars(aux, columns, scalar_aux)
            r, us = sc[RET], sc[U] * (k * k)
            b, lo, hi = (r * b + us, clip_box(r * lo + us, d_min, d_max),
                         clip_box(r * hi + us, d_min, d_max))
        return b, lo, hi

    zero = jnp.zeros(k_ref.shape[-1:], jnp.float32)
    b_ref[...], lo_ref[...], hi_ref[...] = _token_loop(
        k_ref.shape[0], False, unroll, prefetch, loads, group, (zero, zero - BIG, zero + BIG))


def _compose_bwd_kernel(k_ref, aux_ref, d_ref, dkw_ref, m_ref, e_ref, *, bounds, prefetch,
                        unroll, scalar_aux):
    """This program's tokens (in reverse) composed into the one affine map of ``osgm_sweep_bwd``
    (dense rows): the cotangent at the first token is M ⊙ Λ + E for Λ that after the last, from
    the identity (M, E) = (1, 0) by, token by token (m_t the clip's free mask),

        M ← r_t m_t M    E ← r_t m_t E + c_t s_t + ∂k̃_t ⊙ k_t."""
    d_min, d_max = bounds
    columns = (C, RET, U_BWD)

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                d_ref[t], dkw_ref[t].astype(jnp.float32))

    def group(t0, rows, carry):
        del t0
        M, E = carry
        for k, aux, d, dkw in reversed(rows):
            sc = _scalars(aux, columns, scalar_aux)
            s = k * k
            p = sc[RET] * d + sc[U_BWD] * s
            rm = jnp.where((p > d_min) & (p < d_max), sc[RET], 0.0)
            M, E = rm * M, rm * E + sc[C] * s + dkw * k
        return M, E

    one = jnp.ones(k_ref.shape[-1:], jnp.float32)
    m_ref[...], e_ref[...] = _token_loop(k_ref.shape[0], True, unroll, prefetch, loads, group,
                                         (one, one - 1.0))


def _compose_call(kernel, name, args, outputs, block_k, num_warps, interpret):
    """``kernel`` over (row, head, block of ``block_k`` coordinates) of [B, T, H, ·] sequences
    ``args`` (k first, the aux rows second): ``outputs`` maps [B, H, K] float32."""
    k, aux = args[:2]
    B, T, H, K = k.shape
    bk = min(block_k, K)
    seq_k = pl.BlockSpec((None, T, None, bk), lambda b, h, j: (b, 0, h, j))
    seq_aux = pl.BlockSpec((None, T, None, aux.shape[-1]), lambda b, h, j: (b, 0, h, 0))
    state = pl.BlockSpec((None, None, bk), lambda b, h, j: (b, h, j))
    return pl.pallas_call(
        kernel, grid=(B, H, K // bk), in_specs=[seq_k, seq_aux] + [seq_k] * (len(args) - 2),
        out_specs=[state] * outputs,
        out_shape=[out_struct((B, H, K), jnp.float32, *args)] * outputs,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(*args)


def osgm_sweep_compose(k, aux, *, hyper, beta_aware, packed, block_k, prefetch, num_warps,
                       unroll, scalar_aux, interpret):
    """Each row's forward-sweep map (``_compose_kernel``; dense rows only): (b, lo, hi) [B, H, K]
    float32 for k [B, T, H, K] and aux as ``osgm_sweep``'s."""
    del beta_aware
    if packed:
        raise ValueError("osgm_sweep_compose takes dense rows (no cu_seqlens)")
    kernel = functools.partial(_compose_kernel, bounds=hyper[1:3], prefetch=prefetch,
                               unroll=unroll, scalar_aux=scalar_aux)
    return _compose_call(kernel, "osgm_sweep_compose", (k, aux), 3, block_k, num_warps,
                         interpret)


def osgm_sweep_compose_bwd(k, aux, d, dkw, *, hyper, beta_aware, packed, block_k, prefetch,
                           num_warps, unroll, scalar_aux, interpret):
    """Each row's reverse-sweep map (``_compose_bwd_kernel``; dense rows only): (M, E) [B, H, K]
    float32 for k, aux, d, dkw as ``osgm_sweep_bwd``'s."""
    del beta_aware
    if packed:
        raise ValueError("osgm_sweep_compose_bwd takes dense rows (no cu_seqlens)")
    kernel = functools.partial(_compose_bwd_kernel, bounds=hyper[1:3], prefetch=prefetch,
                               unroll=unroll, scalar_aux=scalar_aux)
    return _compose_call(kernel, "osgm_sweep_compose_bwd", (k, aux, d, dkw), 2, block_k,
                         num_warps, interpret)


def _bwd_kernel(k_ref, aux_ref, d_ref, dkw_ref, dfinal_ref, g_ref, *out, bounds, packed, emit,
                prefetch, unroll, scalar_aux):
    """The module docstring's reverse sweep over this program's tokens and coordinates."""
    d_min, d_max = bounds
    mu_ref, dinit_ref = out if emit else (None, None)
    columns = (C, RET, U_BWD) + ((DOC, FIRST, LAST) if packed else ())

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                d_ref[t], dkw_ref[t].astype(jnp.float32))

    def group(t0, rows, D):
        scalars = [_scalars(aux, columns, scalar_aux) for _, aux, _, _ in rows]
        for i in reversed(range(len(rows))):
            (k, _, d, dkw), sc = rows[i], scalars[i]
            s = k * k
            p = sc[RET] * d + sc[U_BWD] * s
            if packed:
                doc, D = _at_boundary(sc, LAST, dfinal_ref, D)
            mu = jnp.where((p > d_min) & (p < d_max), D, 0.0)
            g_ref[t0 + i] = jnp.sum(mu * s)
            if emit:
                mu_ref[t0 + i] = mu
            D = sc[RET] * mu + sc[C] * s + dkw * k
            if packed and emit:
                _store_at(sc, FIRST, dinit_ref, doc, D)
        return D

    D0 = jnp.zeros(k_ref.shape[-1:], jnp.float32) if packed else dfinal_ref[...]
    D = _token_loop(k_ref.shape[0], True, unroll, prefetch, loads, group, D0)
    if emit and not packed:
        dinit_ref[...] = D


def osgm_sweep_bwd(k, aux, d, dkw, dfinal, *, hyper, beta_aware, packed, emit, block_k,
                   prefetch, num_warps, unroll, scalar_aux, interpret):
    """k [B, T, H, K]; aux [B, T, H, AUX] float32 (c_t in the β column, r_t in RET, u_t in column
    5); d [B, T, H, K] float32 (the forward's d_t); dkw [B, T, H, K]; dfinal [N, H, K] float32.
    Returns [the block shares of γ_t [B, H, K / block_k, T] float32] and with ``emit`` also every
    μ_t [B, T, H, K] and dinit [N, H, K], float32."""
    del beta_aware
    kernel = functools.partial(_bwd_kernel, bounds=hyper[1:3], packed=packed, emit=emit,
                               prefetch=prefetch, unroll=unroll, scalar_aux=scalar_aux)
    return _call(kernel, "osgm_sweep_bwd", (k, aux, d, dkw, dfinal), packed=packed,
                 block_k=block_k, emit=emit, emit_dtype=jnp.float32, num_warps=num_warps,
                 interpret=interpret)
