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

and with ``emit`` writes every μ_t (the rest of the cotangents are elementwise in XLA). The
per-token scalars travel in ``osgm_triton``'s aux rows (a forward sweep's u_t in the β column; a
reverse sweep's c_t there and u_t in column 5; r in RET, the document columns as there); the
token loop (groups of ``unroll`` tokens, rows ``prefetch`` groups ahead) is ``osgm_triton``'s.
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
