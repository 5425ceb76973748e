"""The OSGM d scan (SPEC 3.1) parallel in time: Picard iterations on its one scalar coupling.

The coordinates of d interact only through the scalar a_t = ⟨d_t, s_t⟩ (s_t = k_t ⊙ k_t):

    d_{t+1} = clip(r_t d_t + u_t s_t, d_min, d_max)        u_t = w_t (1 − g_t a_t)

(w_t = η g_t / n̄_t, g_t = β_t or 1). Given the sequence u, every coordinate runs its own scan of
maps x ↦ clip(α x + b, lo, hi) with α > 0, and such maps compose into maps of the same form,

    clip(α₂ clip(α₁ x + b₁, l₁, h₁) + b₂, l₂, h₂) = clip(α₂α₁ x + α₂b₁ + b₂, l, h),
    l = clip(α₂ l₁ + b₂, l₂, h₂),  h = clip(α₂ h₁ + b₂, l₂, h₂),

so the scan is associative (``lax.associative_scan``: log T depth; a document's first token is
the constant map to its initial state, α = 0, l = h = b). Picard: start from d frozen at its
initial state, form u, scan, recompute a = ⟨d_t, s_t⟩, repeat until a changes by at most ``tol``.
The clip is continuous, so the iterates approach the token recurrence's own values; how fast
depends on the coupling w g ⟨s_τ, s_t⟩ summed over the retention's memory (the n-th error ~
(c T)^n / n!). Measured on the CPU at T = 2048 with unit keys (session 7, benchmarks/NOTES.md):
4-5 iterations at the paper's η = 0.003 (with and without APF; peaked keys too), ~10 at η = 0.1,
no convergence within 12 at η >= 1, where the token scan (``osgm_reference``) runs instead
(``lax.cond``), so the result is exact either way.

The backward is the same construction on the adjoint: with Λ_t = ∂L/∂(d after token t), m_t the
free mask of the clip at token t and γ_t = ⟨m_t ⊙ Λ_t, s_t⟩ its coupling,

    ∂L/∂d_t = r_t m_t ⊙ Λ_t − w_t g_t γ_t s_t + ∂k̃_t ⊙ k_t,

a per-coordinate linear scan in reverse given γ; Picard on γ from 0, the token scan's pullback
(``jax.vjp`` of ``osgm_reference``) when it does not converge. Then the cotangents of k, β, r and
the initial states follow token by token in parallel (those of ``pallas_kernels.osgm_triton``).
This is the algorithm for a parallel phase 1 on the GPU (each iteration is elementwise work
and a K-reduction over [B, T, H, K]); in XLA as written it is a reference, not a fast path.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from precond_linattn.reference.delta import scan_tokens
from precond_linattn.reference.osgm import osgm_reference, osgm_step_fn
from precond_linattn.varlen import segments


def _compose(f, g):
    """g ∘ f for maps x ↦ clip(α x + b, lo, hi), α >= 0 (each a tuple of arrays)."""
    a1, b1, l1, h1 = f
    a2, b2, l2, h2 = g
    return a2 * a1, a2 * b1 + b2, jnp.clip(a2 * l1 + b2, l2, h2), jnp.clip(a2 * h1 + b2, l2, h2)


def _compose_linear(f, g):
    """g ∘ f for maps x ↦ α x + b."""
    return g[0] * f[0], g[0] * f[1] + g[1]


def coefficients(k, beta, retention, eta, beta_aware, eps):
    """(s, n̄, g, w, r) [B, T, H(, K)] of SPEC 3.1 (k float32; retention None: r ≡ 1)."""
    s = k * k
    n = jnp.maximum(jnp.sum(s, -1), eps)
    g = beta if beta_aware else jnp.ones_like(beta)
    r = jnp.ones_like(beta) if retention is None else retention
    return s, n, g, eta * g / n, r


def cotangents(k, d, dkw, mu, gamma, coefs, eta, eps, beta_aware):
    """(∂k [B, T, H, K], ∂β, ∂r [B, T, H]) token by token, from d_t, ∂k̃_t, μ_t = m_t ⊙ Λ_t
    and γ_t = ⟨μ_t, s_t⟩ (``coefs``: ``coefficients``'s): with a = ⟨d, s⟩, v = 1 − g a,
    u = w v, γ_a = −γ w g and γ_n = −γ v w / n̄ (0 where n̄ is the floor ε),

        ∂s = u μ + γ_a d + γ_n,   ∂k = 2 k ⊙ ∂s + ∂k̃ ⊙ d,   ∂r = ⟨μ, d⟩,
        ∂β = −γ w a + γ v η / n̄  (beta-aware; 0 beta-free)."""
    s, n, g, w, _ = coefs
    a = jnp.sum(d * s, -1)
    v = 1.0 - g * a
    gn = jnp.where(n > eps, -gamma * v * w / n, 0.0)
    ds = (w * v)[..., None] * mu + (-gamma * w * g)[..., None] * d + gn[..., None]
    return (2.0 * k * ds + dkw * d, beta_cotangent(gamma, a, coefs, eta, beta_aware),
            jnp.sum(mu * d, -1))


def beta_cotangent(gamma, a, coefs, eta, beta_aware):
    """∂β [B, T, H] = −γ w a + γ (1 − g a) η / n̄ (beta-aware; 0 beta-free), from γ_t = ⟨μ_t, s_t⟩
    and a_t = ⟨d_t, s_t⟩."""
    _, n, g, w, _ = coefs
    if not beta_aware:
        return jnp.zeros_like(a)
    return -gamma * w * a + gamma * (1.0 - g * a) * eta / n


def _sweep(a, s, g, w, r, first, start, d_min, d_max):
    """One Picard step of the forward: (⟨d_t, s_t⟩, d_t, c_t) for the coupling ``a``, where
    c_t is d after token t, by the associative scan of the clipped affine maps (a document's
    first token: the constant map to its initial state ``start`` [B, T, H, K], then its update)."""
    u = w * (1.0 - g * a)
    first = first[:, :, None, None]  # [B, T] -> over heads and coordinates
    alpha = jnp.broadcast_to(jnp.where(first, 0.0, r[..., None]), s.shape)
    b = jnp.where(first, r[..., None] * start, 0.0) + u[..., None] * s
    maps = (alpha, b, jnp.full_like(s, d_min), jnp.full_like(s, d_max))
    _, b, lo, hi = lax.associative_scan(_compose, maps, axis=1)
    c = jnp.clip(b, lo, hi)  # every row starts with a first token: α = 0 from there on
    d = jnp.where(first, start, jnp.concatenate([start[:, :1], c[:, :-1]], axis=1))
    return jnp.sum(d * s, -1), d, c


def picard_iterate(step, x0, tol, max_iters):
    """Iterate ``x, aux = step(x)`` from x0 until max |Δx| <= tol max(|x|, 1) or ``max_iters``
    steps, in a ``while_loop`` (whose predicate a GPU reads on the host every step; the Pallas
    path's fixed sweeps are ``osgm_precond._iterate``'s): (x, aux, converged, steps)."""
    def body(state):
        x, _, i, _ = state
        x_new, aux = step(x)
        change = jnp.max(jnp.abs(x_new - x)) / jnp.maximum(jnp.max(jnp.abs(x_new)), 1.0)
        return x_new, aux, i + 1, change

    aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(step, x0)[1])
    x, aux, steps, change = lax.while_loop(lambda st: (st[3] > tol) & (st[2] < max_iters), body,
                                           (x0, aux0, jnp.int32(0), jnp.float32(jnp.inf)))
    return x, aux, change <= tol, steps


def _token_scan(k, beta, retention, eta, d_min, d_max, beta_aware, eps, init, seg):
    """Every d_t and c_t by the token recurrence (the fallback)."""
    def step(d, x):
        _, d_next = osgm_step_fn(d, *x, eta, d_min, d_max, beta_aware, eps)
        return d_next, (d, d_next)

    zero = jnp.zeros(k.shape[:1] + k.shape[2:], jnp.float32)
    return scan_tokens(step, zero, (k, beta, retention), seg, init)[0]


def _forward(hyper, k, beta, retention, init, cu_seqlens):
    """(k̃, finals), and (every d_t, every c_t, Picard steps or -1 where the token scan ran)."""
    eta, d_min, d_max, beta_aware, eps, tol, max_iters = hyper
    B, T, H, K = k.shape
    seg = segments(B, T, cu_seqlens)
    start = init[seg.doc]
    s, _, g, w, r = coefficients(k, beta, retention, eta, beta_aware, eps)
    def step(a):
        a_new, d, c = _sweep(a, s, g, w, r, seg.first, start, d_min, d_max)
        return a_new, (d, c)

    _, (d, c), ok, steps = picard_iterate(step, jnp.sum(start * s, -1), tol, max_iters)
    d, c = lax.cond(ok, lambda: (d, c), lambda: _token_scan(
        k, beta, retention, eta, d_min, d_max, beta_aware, eps, init, seg))
    last = jnp.where(seg.last[..., None, None], c, 0.0).reshape(B * T, H, K)
    finals = jax.ops.segment_sum(last, seg.doc.reshape(-1), seg.num_docs)
    return (d * k, finals), (d, jnp.where(ok, steps, -1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _osgm(hyper, k, beta, retention, init, cu_seqlens):
    return _forward(hyper, k, beta, retention, init, cu_seqlens)[0]


def _osgm_fwd(hyper, k, beta, retention, init, cu_seqlens):
    out, (d, _) = _forward(hyper, k, beta, retention, init, cu_seqlens)
    return out, (k, beta, retention, init, cu_seqlens, d)


def _osgm_bwd(hyper, res, cts):
    """The adjoint by Picard iterations on γ_t = ⟨m_t ⊙ Λ_t, s_t⟩ (module docstring), the token
    scan's pullback where they do not converge."""
    eta, d_min, d_max, beta_aware, eps, tol, max_iters = hyper
    k, beta, retention, init, cu_seqlens, d = res
    dkw, dfinal = cts
    B, T, H, K = k.shape
    seg = segments(B, T, cu_seqlens)
    coefs = coefficients(k, beta, retention, eta, beta_aware, eps)
    s, _, g, w, r = coefs
    u = w * (1.0 - g * jnp.sum(d * s, -1))
    p = r[..., None] * d + u[..., None] * s
    m = ((p > d_min) & (p < d_max)).astype(jnp.float32)
    first, last = seg.first[:, :, None, None], seg.last[:, :, None, None]
    e = jnp.where(last, dfinal[seg.doc], 0.0)  # the finals' cotangents
    alpha = jnp.where(last, 0.0, r[..., None] * m)

    def sweep(gamma):
        """D_t = ∂L/∂d_t = r m (e + [not last] D_{t+1}) − w g γ s + ∂k̃ ⊙ k, by a reverse scan;
        returns (⟨m Λ, s⟩, (D, Λ))."""
        b = r[..., None] * m * e - (w * g * gamma)[..., None] * s + dkw * k
        _, D = lax.associative_scan(_compose_linear, (alpha, b), axis=1, reverse=True)
        lam = e + jnp.where(last, 0.0,
                            jnp.concatenate([D[:, 1:], jnp.zeros_like(D[:, :1])], axis=1))
        return jnp.sum(m * lam * s, -1), (D, lam)

    gamma, (D, lam), ok, _ = picard_iterate(sweep, jnp.zeros_like(u), tol, max_iters)

    def picard_grads():
        dk, dbeta, dr = cotangents(k, d, dkw, m * lam, gamma, coefs, eta, eps, beta_aware)
        dr = None if retention is None else dr
        dstart = jnp.where(first, D, 0.0).reshape(B * T, H, K)
        dinit = jax.ops.segment_sum(dstart, seg.doc.reshape(-1), seg.num_docs)
        return dk, dbeta, dr, dinit

    def token_scan_grads():
        _, pullback = jax.vjp(lambda *x: osgm_reference(
            *x[:3], eta, d_min, d_max, beta_aware, eps, x[3], cu_seqlens), k, beta, retention,
            init)
        return pullback((dkw, dfinal))

    return (*lax.cond(ok, picard_grads, token_scan_grads), None)


_osgm.defvjp(_osgm_fwd, _osgm_bwd)


def _hyper_and_init(k, eta, d_min, d_max, beta_aware, eps, initial_state, cu_seqlens, tol,
                    max_iters):
    B, _, H, K = k.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = jnp.ones((n, H, K), jnp.float32) if initial_state is None else initial_state
    return (eta, d_min, d_max, beta_aware, eps, tol, max_iters), init


def osgm_picard(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state, cu_seqlens,
                tol=1e-6, max_iters=16):
    """k̃ [B, T, H, K] and final states d [N, H, K] (float32), as ``osgm_reference`` (same
    arguments, float32), by Picard iterations (module docstring), differentiable. ``tol``: the
    relative change of the coupling at which an iteration counts as converged; ``max_iters``:
    the iterations before the token scan runs instead."""
    hyper, init = _hyper_and_init(k, eta, d_min, d_max, beta_aware, eps, initial_state,
                                  cu_seqlens, tol, max_iters)
    return _osgm(hyper, k, beta, retention, init, cu_seqlens)


def osgm_picard_steps(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state,
                      cu_seqlens, tol=1e-6, max_iters=16):
    """The Picard iterations the forward of ``osgm_picard`` takes (-1: it fell back)."""
    hyper, init = _hyper_and_init(k, eta, d_min, d_max, beta_aware, eps, initial_state,
                                  cu_seqlens, tol, max_iters)
    return _forward(hyper, k, beta, retention, init, cu_seqlens)[1][1]
