"""The OSGM / OSDN preconditioner (SPEC 3.1) by chunks: exact, differentiable by plain autodiff.

Per token, with s_t = k_t ⊙ k_t, n̄_t = max(‖k_t‖², ε), b_t = η β_t^a / n̄_t,
c_t = η β_t^{2a} / n̄_t (a = 1 beta-aware, 0 beta-free) and the scalar u_t = b_t − c_t ⟨s_t, d_t⟩:

    d_{t+1} = clip(p_t, d_min, d_max)        p_t = r_t d_t + u_t s_t   (the pre-clip value)

Without the clip this is a delta rule with value dimension 1. Inside a chunk of C tokens
(d_i the state before its token i = 0..C-1, d_0 the chunk start, d_C its end), with
ρ_i = Π_{m<i} r_m and E_ij = ρ_i / ρ_{j+1} for j < i
(0 otherwise; exp of masked differences of the cumulative log r, every exponent ≤ 0 for r ≤ 1):

    (I + L) u = b − c ⊙ ⟨s_i, y_i⟩        L_ij = c_i E_ij ⟨s'_i, s'_j⟩   (unit lower-triangular)
    d_i = y_i + Σ_{j<i} E_ij u_j s'_j      (i = 0..C, one [C+1, C] × [C, K] product)

Active set. Coordinates of d_0 exactly on a bound (as a clip leaves them) are assumed pinned there
for the whole chunk, the others free: s' = s ⊙ free, y_i = ρ_i d_0 on free coordinates and the
bound on pinned ones (y_0 = d_0). The hypothesis holds when, for every token of the chunk, every
free coordinate has d_min < p_t < d_max and every pinned one has p_t on or beyond its bound
(≥ d_max pinned high, ≤ d_min pinned low); then the d_i above are exactly the clipped recurrence,
and autodiff through this masked affine form gives the reference's gradients (pinned coordinates
are constants, free ones pass through the identity of the clip; a tie on a bound counts as
pinned, as in ``reference.osgm.clip_box``). A token with c_t ‖s_t‖² > 1 + r_t (a step that can
expand) sends its chunk to the fallback and enters the (still evaluated) solve with c_t = 0: with
c_t ‖s_t‖² ≤ 1 + r_t every step's linear part x ↦ r_t x − c_t s_t ⟨s_t, x⟩ has norm ≤ 1, so the
solve stays finite, and no inf or NaN reaches the gradients through the zero cotangents of the
branch not taken.

A ``lax.scan`` over document-aligned chunks evaluates this for all rows, then ``lax.cond`` on ONE
global predicate (for every row and token of the chunk the hypothesis holds and no step can
expand) keeps it or runs the exact token-by-token fallback (``osgm_step_fn``) over the chunk (a
batched predicate, e.g. under vmap, would run both branches). The fast path applies whenever no
coordinate crosses into or out of the box within the chunk: always when the clip is inactive
(e.g. the paper's η = 0.003 with unit keys, d near 1), and in steady states where coordinates
stay pinned. The fallback is the reference recurrence, so results are exact either way. Padding
slots (k = 0, β = 0, r = 1) leave d unchanged in both branches.
"""

import jax
import jax.numpy as jnp

from precond_linattn.chunked.gram import causal_mask
from precond_linattn.numerics import einsum
from precond_linattn.reference.osgm import osgm_step_fn
from precond_linattn.varlen import chunk_layout, from_chunks, reset, to_chunks


def _scan_major(x, layout, fill=0.0):
    """[B, T, H, ...] -> [NC, B, H, C, ...]."""
    return jnp.moveaxis(to_chunks(x, layout, fill), (1, 3), (0, 2))


def _active_set_solution(d0, k, b, c, r, rho, E, d_min, d_max):
    """The chunk under the active-set hypothesis: (k̃ [B,H,C,K], d_C [B,H,K], hypothesis holds).

    d0 [B,H,K]; k [B,H,C,K]; b, c, r [B,H,C]; rho [B,H,C+1]; E [B,H,C+1,C]."""
    C = k.shape[-2]
    s = k * k
    hi = d0 == d_max
    lo = (d0 == d_min) & ~hi
    free = ~(hi | lo)
    start = (jnp.arange(C + 1) == 0)[:, None]
    y = jnp.where(free[..., None, :] | start, rho[..., None] * d0[..., None, :],
                  jnp.where(hi, d_max, d_min)[..., None, :])
    sf = jnp.where(free[..., None, :], s, 0.0)
    L = c[..., None] * E[..., :C, :] * einsum("...ik,...jk->...ij", sf, sf)
    rhs = b - c * einsum("...ck,...ck->...c", s, y[..., :C, :])
    u = jax.scipy.linalg.solve_triangular(jnp.eye(C) + L, rhs[..., None], lower=True,
                                          unit_diagonal=True)[..., 0]
    d = y + einsum("...ij,...jk->...ik", E, u[..., None] * sf)
    p = r[..., None] * d[..., :C, :] + u[..., None] * s
    inside = (p > d_min) & (p < d_max)
    holds = jnp.where(hi[..., None, :], p >= d_max, jnp.where(lo[..., None, :], p <= d_min, inside))
    return d[..., :C, :] * k, d[..., C, :], jnp.all(holds)


def _chunks(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state, cu_seqlens,
            chunk_size):
    """(k̃ [B,T,H,K], final d [N,H,K], fast path taken per chunk [NC])."""
    B, T, H, K = k.shape
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    if retention is None:
        retention = jnp.ones_like(beta)
    if initial_state is None:
        initial_state = jnp.ones((layout.num_docs, H, K), jnp.float32)
    kc, bc = _scan_major(k, layout), _scan_major(beta, layout)
    rc = _scan_major(retention, layout, 1.0)  # padding: r = 1
    s = kc * kc
    n = jnp.maximum(jnp.sum(s, axis=-1), eps)
    g = bc if beta_aware else jnp.ones_like(bc)
    b, c = eta * g / n, eta * g * g / n
    stable = c * jnp.sum(s * s, axis=-1) <= 1.0 + rc
    log_r = jnp.log(jnp.maximum(rc, jnp.finfo(jnp.float32).tiny))  # r = 0 stays finite
    gam = jnp.concatenate([jnp.zeros_like(log_r[..., :1]), jnp.cumsum(log_r, axis=-1)], axis=-1)
    mask = causal_mask(chunk_size + 1, strict=True)[:, :chunk_size]
    E = jnp.exp(jnp.where(mask, gam[..., :, None] - gam[..., None, 1:], -jnp.inf))
    step_args = (eta, d_min, d_max, beta_aware, eps)

    def fallback(_, d0, tokens):
        def step(d, inp):
            k_write, d = osgm_step_fn(d, *inp, *step_args)
            return d, k_write

        d, k_write = jax.lax.scan(step, d0, jax.tree.map(lambda a: jnp.moveaxis(a, 2, 0), tokens))
        return jnp.moveaxis(k_write, 0, 2), d

    def body(d, x):
        k_c, beta_c, r_c, b_c, c_c, rho_c, E_c, stable_c, doc, first = x
        d0 = reset(d, initial_state, doc, first)
        solution = _active_set_solution(d0, k_c, b_c, jnp.where(stable_c, c_c, 0.0), r_c, rho_c,
                                        E_c, d_min, d_max)
        fast = solution[2] & jnp.all(stable_c)
        k_write, d = jax.lax.cond(fast, lambda sol, *_: sol[:2], fallback, solution, d0,
                                  (k_c, beta_c, r_c))
        return d, (k_write, d, fast)

    xs = (kc, bc, rc, b, c, jnp.exp(gam), E, stable, layout.doc.T, layout.first.T)
    _, (k_write, d_end, fast) = jax.lax.scan(body, jnp.zeros((B, H, K), jnp.float32), xs)
    k_write = from_chunks(jnp.moveaxis(k_write, (0, 2), (1, 3)), layout)
    return k_write, d_end[layout.final_chunk, layout.final_row], fast


def osgm_chunked(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state, cu_seqlens,
                 chunk_size):
    """k̃ [B, T, H, K] and final states d [N, H, K] (float32); arguments as ``osgm_reference``."""
    return _chunks(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state,
                   cu_seqlens, chunk_size)[:2]


def fast_path_chunks(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state,
                     cu_seqlens, chunk_size):
    """For tests and diagnostics: [NC] bool, True where a chunk took the active-set fast path."""
    return _chunks(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state,
                   cu_seqlens, chunk_size)[2]
