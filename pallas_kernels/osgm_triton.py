"""The OSGM / OSDN d scan (SPEC 3.1) as Pallas Triton-lowered kernels, forward and reverse.

One program per (batch row, head) walks its tokens in order with d [K] in registers (float32):

    s = k ⊙ k    n̄ = max(Σ s, ε)    g = β (beta-aware) or 1    w = η g / n̄
    a = ⟨d, s⟩   u = w (1 − g a)    p = r d + u s              (p: the pre-clip value)
    k̃_t = d ⊙ k                     d ← clip(p, d_min, d_max)  (derivative m = d_min < p < d_max)

The backward kernel runs the same token loop in reverse with λ = ∂L/∂d_{t+1} in registers and
d_t read back from a buffer the forward kernel writes in its ``emit_d`` mode (recomputed in the
backward, never kept as a residual). With μ = m ⊙ λ, γ_u = ⟨μ, s⟩ and γ_a = −γ_u w g:

    ∂L/∂d_t = r μ + γ_a s + ∂k̃ ⊙ k        ∂L/∂r = ⟨μ, d⟩
    ∂L/∂s   = u μ + γ_a d + [Σ s > ε] γ_n   γ_n = −γ_u (1 − g a) w / n̄
    ∂L/∂k   = 2 k ⊙ ∂L/∂s + ∂k̃ ⊙ d         ∂L/∂β = −γ_u w a + γ_u (1 − g a) η / n̄  (beta-aware)

Layout: k [B, T, H, K] (K a power of two, padded keys zero); the per-token scalars travel in one
float32 row ``aux`` [B, T, H, AUX] = (β, r, document, first, last, 0, 0, 0) so that a token costs
two row loads, which the loop issues ``prefetch`` tokens ahead (a token's work is a short chain
of warp reductions; unhidden global-load latency would dominate it). Dense batches (``packed``
False) map each row's initial and final state by BlockSpec and ignore the document columns;
packed documents (B = 1) restart d from initial[doc] at a document's first token and store
final[doc] after its last.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.triton_common import column, out_struct, prefetched_loop

AUX = 8  # columns of the per-token row: beta, retention, doc, first, last, (unused)
BETA, RET, DOC, FIRST, LAST = range(5)


def _coefficients(k, aux, eta, eps, beta_aware):
    """(s, Σ s, n̄, g, w, r) of one token."""
    s = k * k
    ss = jnp.sum(s)
    n = jnp.maximum(ss, eps)
    g = column(aux, BETA) if beta_aware else 1.0
    return s, ss, n, g, eta * g / n, column(aux, RET)


def _fwd_kernel(k_ref, aux_ref, init_ref, out_ref, final_ref, *, hyper, beta_aware, packed,
                emit_d, prefetch):
    eta, d_min, d_max, eps = hyper
    T = k_ref.shape[0]

    def loads(t):
        return k_ref[t].astype(jnp.float32), aux_ref[t]

    def body(t, rows, d):
        k, aux = rows
        doc = column(aux, DOC).astype(jnp.int32)
        if packed:
            d = lax.cond(column(aux, FIRST) != 0, lambda: init_ref[doc], lambda: d)
        out_ref[t] = d if emit_d else (d * k).astype(out_ref.dtype)
        s, _, _, g, w, r = _coefficients(k, aux, eta, eps, beta_aware)
        p = r * d + w * (1.0 - g * jnp.sum(d * s)) * s
        d = jnp.where(p >= d_max, d_max, jnp.where(p <= d_min, d_min, p))
        if packed:
            @pl.when(column(aux, LAST) != 0)
            def _():
                final_ref[doc] = d
        return d

    d0 = jnp.ones(k_ref.shape[-1:], jnp.float32) if packed else init_ref[...]
    d = prefetched_loop(T, False, prefetch, loads, body, d0)
    if not packed:
        final_ref[...] = d


def _bwd_kernel(k_ref, aux_ref, d_ref, dkw_ref, dfinal_ref, dk_ref, daux_ref, dinit_ref, *,
                hyper, beta_aware, packed, prefetch):
    eta, d_min, d_max, eps = hyper
    T = k_ref.shape[0]
    col = lax.broadcasted_iota(jnp.int32, (AUX,), 0)

    def loads(t):
        return (k_ref[t].astype(jnp.float32), aux_ref[t], d_ref[t],
                dkw_ref[t].astype(jnp.float32))

    def body(t, rows, lam):
        k, aux, d, dkw = rows
        doc = column(aux, DOC).astype(jnp.int32)
        if packed:
            lam = lax.cond(column(aux, LAST) != 0, lambda: dfinal_ref[doc], lambda: lam)
        s, ss, n, g, w, r = _coefficients(k, aux, eta, eps, beta_aware)
        a = jnp.sum(d * s)
        v = 1.0 - g * a
        u = w * v
        p = r * d + u * s
        mu = jnp.where((p > d_min) & (p < d_max), lam, 0.0)
        gu = jnp.sum(mu * s)
        ga = -gu * w * g
        gn = jnp.where(ss > eps, -gu * v * w / n, 0.0)
        dk_ref[t] = 2.0 * k * (u * mu + ga * d + gn) + dkw * d
        dbeta = (-gu * w * a + gu * v * eta / n) if beta_aware else 0.0
        daux_ref[t] = jnp.where(col == BETA, dbeta, jnp.where(col == RET, jnp.sum(mu * d), 0.0))
        lam = r * mu + ga * s + dkw * k
        if packed:
            @pl.when(column(aux, FIRST) != 0)
            def _():
                dinit_ref[doc] = lam
        return lam

    lam0 = jnp.zeros(k_ref.shape[-1:], jnp.float32) if packed else dfinal_ref[...]
    lam = prefetched_loop(T, True, prefetch, loads, body, lam0)
    if not packed:
        dinit_ref[...] = lam


def _specs(T, K, num_docs, packed):
    seq_k = pl.BlockSpec((None, T, None, K), lambda b, h: (b, 0, h, 0))
    seq_aux = pl.BlockSpec((None, T, None, AUX), lambda b, h: (b, 0, h, 0))
    if packed:
        state = pl.BlockSpec((num_docs, None, K), lambda b, h: (0, h, 0))
    else:
        state = pl.BlockSpec((None, None, K), lambda b, h: (b, h, 0))
    return seq_k, seq_aux, state


def osgm_fwd(k, aux, initial_state, *, hyper, beta_aware, packed, emit_d, prefetch, num_warps,
             interpret):
    """k [B, T, H, K]; aux [B, T, H, AUX] float32; initial_state [N, H, K] float32 (N = B unless
    ``packed``). Returns (k̃ in k's dtype, or every d_t float32 if ``emit_d``; final d [N, H, K])."""
    B, T, H, K = k.shape
    N = initial_state.shape[0]
    seq_k, seq_aux, state = _specs(T, K, N, packed)
    kernel = functools.partial(_fwd_kernel, hyper=hyper, beta_aware=beta_aware, packed=packed,
                               emit_d=emit_d, prefetch=prefetch)
    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[seq_k, seq_aux, state], out_specs=[seq_k, state],
        out_shape=[out_struct(k.shape, jnp.float32 if emit_d else k.dtype, k, aux, initial_state),
                   out_struct((N, H, K), jnp.float32, k, aux, initial_state)],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="osgm_fwd",
    )(k, aux, initial_state)


def osgm_bwd(k, aux, d, dkw, dfinal, *, hyper, beta_aware, packed, prefetch, num_warps,
             interpret):
    """Cotangents (dk [B, T, H, K], daux [B, T, H, AUX] (β and r columns), dinit [N, H, K]), all
    float32, from d [B, T, H, K] (``osgm_fwd(emit_d=True)``), dk̃ and dfinal."""
    B, T, H, K = k.shape
    N = dfinal.shape[0]
    seq_k, seq_aux, state = _specs(T, K, N, packed)
    kernel = functools.partial(_bwd_kernel, hyper=hyper, beta_aware=beta_aware, packed=packed,
                               prefetch=prefetch)
    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[seq_k, seq_aux, seq_k, seq_k, state],
        out_specs=[seq_k, seq_aux, state],
        out_shape=[out_struct(shape, jnp.float32, k, aux, d, dkw, dfinal)
                   for shape in (k.shape, aux.shape, (N, H, K))],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="osgm_bwd",
    )(k, aux, d, dkw, dfinal)
