"""The OSGM / OSDN d recurrence (SPEC 3.1) one token at a time, inside Pallas Triton kernels.

These are the exact token-by-token pieces the chunk kernels (``osgm_chunk_triton``) fall back to
when a chunk's active set changes, with d (or λ = ∂L/∂d) [K] float32 in registers:

    s = k ⊙ k    n̄ = max(Σ s, ε)    g = β (beta-aware) or 1    w = η g / n̄
    a = ⟨d, s⟩   u = w (1 − g a)    p = r d + u s              (p: the pre-clip value)
    k̃_t = d ⊙ k                     d ← clip(p, d_min, d_max)  (derivative m = d_min < p < d_max)

Reverse, with λ = ∂L/∂d_{t+1}, μ = m ⊙ λ, γ_u = ⟨μ, s⟩ and γ_a = −γ_u w g:

    ∂L/∂d_t = r μ + γ_a s + ∂k̃ ⊙ k        ∂L/∂r = ⟨μ, d⟩
    ∂L/∂s   = u μ + γ_a d + [Σ s > ε] γ_n   γ_n = −γ_u (1 − g a) w / n̄
    ∂L/∂k   = 2 k ⊙ ∂L/∂s + ∂k̃ ⊙ d         ∂L/∂β = −γ_u w a + γ_u (1 − g a) η / n̄  (beta-aware)

The per-token scalars travel in one float32 row ``aux`` [..., AUX] = (β, r), so that a token
costs two row loads, which the loops issue ``prefetch`` tokens ahead (a token's work is a short
chain of warp reductions; unhidden global-load latency would dominate it).
"""

import jax.numpy as jnp
from jax import lax

AUX = 2  # columns of the per-token row: beta, retention
BETA, RET = range(AUX)


def column(aux, i):
    """Column i of loaded aux rows [..., AUX] as [...] (loaded values cannot be indexed)."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, aux.shape, aux.ndim - 1) == i, aux,
                             0.0), axis=-1)


def coefficients(k, aux, eta, eps, beta_aware):
    """(s, Σ s, n̄, g, w, r) of one token (k [K], aux [AUX]) or of a tile of tokens (k [C, K],
    aux [C, AUX]: the scalars become [C] vectors)."""
    s = k * k
    ss = jnp.sum(s, axis=-1)
    n = jnp.maximum(ss, eps)
    g = column(aux, BETA) if beta_aware else jnp.ones_like(ss)
    return s, ss, n, g, eta * g / n, column(aux, RET)


def token_loop(start, n, reverse, prefetch, loads, body, carry):
    """``body(t, rows, carry) -> carry`` for t over [start, start + n) (descending if ``reverse``),
    where ``rows = loads(t)`` was issued ``prefetch`` iterations earlier (indices kept in range)."""
    def at(i):
        return start + jnp.clip(n - 1 - i if reverse else i, 0, n - 1)

    def step(i, state):
        carry, queue = state
        carry = body(at(i), queue[0], carry)
        return carry, (*queue[1:], loads(at(i + prefetch)))

    queue = tuple(loads(at(i)) for i in range(prefetch))
    return lax.fori_loop(0, n, step, (carry, queue))[0]


def token_forward(d, k, aux, *, hyper, beta_aware):
    """d_{t+1} = clip(r d + w (1 − g ⟨d, s⟩) s, d_min, d_max) from d_t, k_t [K], aux_t [AUX]."""
    eta, d_min, d_max, eps = hyper
    s, _, _, g, w, r = coefficients(k, aux, eta, eps, beta_aware)
    p = r * d + w * (1.0 - g * jnp.sum(d * s)) * s
    return jnp.where(p >= d_max, d_max, jnp.where(p <= d_min, d_min, p))


def token_backward(lam, d, k, aux, dkw, *, hyper, beta_aware):
    """(∂L/∂k_t [K], (∂L/∂β_t, ∂L/∂r_t) [AUX], ∂L/∂d_t [K]) from λ = ∂L/∂d_{t+1}, d_t, k_t,
    aux_t and ∂k̃_t (the reverse step of the module docstring)."""
    eta, d_min, d_max, eps = hyper
    s, ss, n, g, w, r = coefficients(k, aux, eta, eps, beta_aware)
    a = jnp.sum(d * s)
    v = 1.0 - g * a
    u = w * v
    p = r * d + u * s
    mu = jnp.where((p > d_min) & (p < d_max), lam, 0.0)
    gu = jnp.sum(mu * s)
    ga = -gu * w * g
    gn = jnp.where(ss > eps, -gu * v * w / n, 0.0)
    dk = 2.0 * k * (u * mu + ga * d + gn) + dkw * d
    dbeta = (-gu * w * a + gu * v * eta / n) if beta_aware else 0.0
    col = lax.broadcasted_iota(jnp.int32, (AUX,), 0)
    daux = jnp.where(col == BETA, dbeta, jnp.sum(mu * d))
    return dk, daux, r * mu + ga * s + dkw * k
