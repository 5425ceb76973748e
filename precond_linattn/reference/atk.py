"""The ATK / PDN diagonal preconditioner of SPEC 3.2, one token at a time (float32 state).

    A_t  = exp(g_t) ⊙ A_{t−1} + gain_t (k_t ⊙ k_t)     (g scalar per head or per channel)
    ρ_t  = log(A_t + ε) − c_h
    σ_t  = ρ_t / (1 + |ρ_t|)
    B_t  = exp(−log(x) · σ_t)                          (in [1/x, x])
    k̃_t = B_t ⊙ k_t                                   (uses the CURRENT A_t)
"""

import jax.numpy as jnp

from precond_linattn.reference.delta import scan_tokens
from precond_linattn.varlen import segments


def atk_squash(A, k, center, x, eps):
    """k̃ = exp(−log(x) σ(log(A + ε) − c)) ⊙ k for A, k [..., H, K] and center c [H]."""
    rho = jnp.log(A + eps) - center[:, None]
    return jnp.exp(-jnp.log(x) * (rho / (1.0 + jnp.abs(rho)))) * k


def atk_step_fn(A, k, g, gain, center, x, eps):
    """One token for all rows: A, k [B, H, K]; g [B, H] or [B, H, K]; gain [B, H]; center [H].

    Returns (A_t, k̃_t)."""
    alpha = jnp.exp(g)
    if alpha.ndim == A.ndim - 1:
        alpha = alpha[..., None]
    A = alpha * A + gain[..., None] * (k * k)
    return A, atk_squash(A, k, center, x, eps)


def atk_reference(k, g, gain, center, x, eps, initial_state, cu_seqlens):
    """k̃ [B, T, H, K] and final states A [N, H, K] (float32) by a scan over tokens.

    k [B, T, H, K]; g [B, T, H] or [B, T, H, K]; gain [B, T, H]; center [H];
    initial_state [N, H, K] or None (zeros)."""
    B, T, H, K = k.shape

    def step(A, inp):
        return atk_step_fn(A, *inp, center, x, eps)

    A0 = jnp.zeros((B, H, K), jnp.float32)
    return scan_tokens(step, A0, (k, g, gain), segments(B, T, cu_seqlens), initial_state)
