"""The delta core in chunked WY form (SPEC 2.1), pure JAX, differentiable, any backend.

Per chunk of C tokens (γ the cumulative log decay from the chunk start, Γ = exp γ):

    L   = strict_tril( β_i ⟨k_i ⊙ Γ_i/Γ_j, k̃_j⟩ )            T = (I + L)^-1
    W   = T Diag(β) (K ⊙ Γ)       U = T Diag(β) V            (one triangular solve)
    R   = U − W S_0                                            (rows r_t = β_t u_t)
    S_C = Γ_C ⊙ S_0 + (K̃ ⊙ Γ_C/Γ)ᵀ R
    O   = scale · [ (Q ⊙ Γ) S_0 + tril(⟨q_i ⊙ Γ_i/Γ_j, k̃_j⟩) R ]

W, U and the intra-chunk products run in parallel over all chunks; only S_0 → S_C is a scan
over chunks.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from precond_linattn.chunked.gram import decayed_gram
from precond_linattn.numerics import einsum
from precond_linattn.varlen import chunk_layout, from_chunks, reset, to_chunks


def _chunked(x, layout):
    """[B, T, H, ...] -> [B, H, NC, C, ...] in float32."""
    y = to_chunks(x, layout)
    return jnp.moveaxis(y, 3, 1).astype(jnp.float32)


def _masked_sums(x, axis, M):
    """y_i = Σ_t M_it x_t along ``axis`` (M [C, C] of zeros and ones), one matmul in x's dtype
    (exact products, each y_i a sum of only its own terms). No reshape merges the other axes:
    a sharded batch or head axis stays sharded (a merged one was all-gathered on a mesh)."""
    y = lax.dot_general(x, M.astype(x.dtype), (((axis,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype)
    return jnp.moveaxis(y, -1, axis)


def _strictly_upper(C):
    """M_it = [t > i], float32 [C, C]."""
    return (jnp.arange(C)[None, :] > jnp.arange(C)[:, None]).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def suffix_sums(g, axis):
    """σ_i = Σ_{t>i} g_t of float log decays along ``axis`` (0 at the last position): the
    exponent of Γ_C/Γ = exp(σ), γ_C − γ_i formed without a difference, so that its pullback,
    dg_t = Σ_{i<t} dσ_i, sums only its own terms (with γ_C − γ_i the last real row of a padded
    chunk, σ = 0 over the pads, gave dγ two O(1) shares that cancel, whose rounding is all of dg
    where the chunk decays away). Both ways a batched matmul by a 0/1 mask (the scalar WY kernels
    form σ by the same mask; XLA's reverse cumsum and its transpose were reduce-windows on the
    GPU)."""
    return _masked_sums(g, axis, _strictly_upper(g.shape[axis]))


def _suffix_sums_fwd(g, axis):
    return suffix_sums(g, axis), None


def _suffix_sums_bwd(axis, _, dsigma):
    return (_masked_sums(dsigma, axis, _strictly_upper(dsigma.shape[axis]).T),)


suffix_sums.defvjp(_suffix_sums_fwd, _suffix_sums_bwd)


def decay_sums(g, axis):
    """(γ, σ) of per-token log decays g (float) along the in-chunk ``axis``: the inclusive
    cumsum γ (the log decay from the chunk start; the WY kernels take the same cumsum) and
    ``suffix_sums`` σ = γ_C − γ."""
    return jnp.cumsum(g, axis), suffix_sums(g, axis)


def _decay_factors(gamma, sigma, like):
    """(Γ broadcastable to rows [.., C, 1|K], Γ_C/Γ = exp σ likewise, Γ_C broadcastable to S
    [.., K, 1]); σ = ``suffix_sums`` of the chunk's log decays."""
    if gamma is None:
        ones = jnp.ones(like.shape[:-1] + (1,), jnp.float32)
        return ones, ones, ones[..., :1, :]
    if gamma.ndim == like.ndim - 1:  # scalar: [B,H,NC,C]
        return (jnp.exp(gamma)[..., None], jnp.exp(sigma)[..., None],
                jnp.exp(gamma[..., -1:])[..., None])
    return jnp.exp(gamma), jnp.exp(sigma), jnp.exp(jnp.swapaxes(gamma[..., -1:, :], -1, -2))


def chunk_grams(qc, kc, kwc, bc, gamma):
    """L = strict_tril(β_i ⟨k_i ⊙ Γ_i/Γ_j, k̃_j⟩) and P = tril(⟨q_i ⊙ Γ_i/Γ_j, k̃_j⟩), [.., C, C]."""
    L = bc[..., :, None] * decayed_gram(kc, kwc, gamma, strict=True)
    return L, decayed_gram(qc, kwc, gamma, strict=False)


def solve_unit_lower(L, rhs):
    """(I + L)^-1 rhs for strictly lower-triangular L, by forward substitution."""
    eye = jnp.eye(L.shape[-1], dtype=L.dtype)
    return jax.scipy.linalg.solve_triangular(eye + L, rhs, lower=True, unit_diagonal=True)


def chunk_wy(qc, kc, kwc, vc, bc, gamma, sigma, solve=solve_unit_lower):
    """Per-chunk WY tensors from chunk views [B, H, NC, C, ·] (float32), γ the in-chunk cumsum
    and σ its ``suffix_sums`` (γ_C − γ; None with γ):

    (W, U, K̃ ⊙ exp σ, Q ⊙ Γ, P, Γ_C) with [W, U] = solve(L, Diag(β) [K ⊙ Γ, V]), where
    ``solve(L, rhs)`` computes (I + L)^-1 rhs."""
    K = kc.shape[-1]
    Gam, tail, Gam_C = _decay_factors(gamma, sigma, kc)
    L, P = chunk_grams(qc, kc, kwc, bc, gamma)
    WU = solve(L, bc[..., None] * jnp.concatenate([kc * Gam, vc], axis=-1))
    return WU[..., :K], WU[..., K:], kwc * tail, qc * Gam, P, Gam_C


def delta_rule_chunked(q, k, kw, v, beta, g, scale, initial_state, cu_seqlens, chunk_size):
    """o [B,T,H,V] and final states [N,H,K,V] (float32)."""
    B, T, H, K = k.shape
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    qc, kc, kwc, vc = (_chunked(x, layout) for x in (q, k, kw, v))
    bc = _chunked(beta, layout)
    gamma, sigma = (None, None) if g is None else decay_sums(_chunked(g, layout), 3)
    W, U, kw_tail, q_dec, P, Gam_C = chunk_wy(qc, kc, kwc, vc, bc, gamma, sigma)

    def body(S, x):
        W_c, U_c, kwt_c, GC_c, doc, first = x
        S = reset(S, initial_state, doc, first)
        R = U_c - einsum("bhck,bhkv->bhcv", W_c, S)
        S_next = GC_c * S + einsum("bhck,bhcv->bhkv", kwt_c, R)
        return S_next, (S, R)

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (W, U, kw_tail, Gam_C)) + (layout.doc.T, layout.first.T)
    S0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    _, (S_pre, R) = jax.lax.scan(body, S0, xs)
    S_pre, R = jnp.moveaxis(S_pre, 0, 2), jnp.moveaxis(R, 0, 2)  # [B,H,NC,K,V], [B,H,NC,C,V]

    o = scale * (einsum("bhnck,bhnkv->bhncv", q_dec, S_pre) + einsum("bhncd,bhndv->bhncv", P, R))
    o = from_chunks(jnp.moveaxis(o, 1, 3), layout)

    rows, chunks = layout.final_row, layout.final_chunk
    last = (rows, slice(None), chunks)
    finals = Gam_C[last] * S_pre[last] + einsum("nhck,nhcv->nhkv", kw_tail[last], R[last])
    return o, finals
