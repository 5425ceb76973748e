"""The delta core of SPEC section 2, one token at a time (float32 state).

    S̄_{t-1} = S_{t-1} | exp(g_t) S_{t-1} | Diag(exp(g_t)) S_{t-1}   (none / scalar / vector decay)
    u_t     = v_t − S̄_{t-1}ᵀ k_t
    S_t     = S̄_{t-1} + β_t k̃_t u_tᵀ
    o_t     = S_tᵀ (scale · q_t)
"""

import jax
import jax.numpy as jnp

from precond_linattn.numerics import einsum
from precond_linattn.varlen import reset, segments


def decay_state(S, g):
    """S̄ = exp(g) ⊙ S for S [B, H, K, V] and g None, [B, H] or [B, H, K]."""
    if g is None:
        return S
    alpha = jnp.exp(g)
    return S * (alpha[..., None, None] if alpha.ndim == 2 else alpha[..., None])


def delta_step(S, q, k, kw, v, beta, g, scale):
    """One token for all rows: S [B,H,K,V]; q, k, kw [B,H,K]; v [B,H,V]; beta [B,H].

    Returns (S_t, o_t, u_t, S̄_{t-1})."""
    S_bar = decay_state(S, g)
    u = v - einsum("bhkv,bhk->bhv", S_bar, k)
    S_new = S_bar + beta[..., None, None] * kw[..., :, None] * u[..., None, :]
    o = einsum("bhkv,bhk->bhv", S_new, scale * q)
    return S_new, o, u, S_bar


def scan_tokens(step, carry0, xs, seg, initial):
    """Scan ``step(carry, x_t) -> (carry, y_t)`` over T with document resets.

    carry0 [B, ...]; xs leaves [B, T, ...]; at each document's first token the carry restarts
    from initial[doc] (zeros when None); returns (ys [B, T, ...], finals [N, ...])."""
    finals0 = jnp.zeros((seg.num_docs, *carry0.shape[1:]), carry0.dtype)

    def body(state, inp):
        carry, finals = state
        x, doc, first, last = inp
        carry = reset(carry, initial, doc, first)
        carry, y = step(carry, x)
        keep = last.reshape(last.shape + (1,) * (carry.ndim - 1))
        finals = finals.at[doc].set(jnp.where(keep, carry, finals[doc]))
        return (carry, finals), y

    time_major = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), (xs, seg.doc, seg.first, seg.last))
    (_, finals), ys = jax.lax.scan(body, (carry0, finals0), time_major)
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), ys), finals


def delta_rule_reference(q, k, kw, v, beta, g, scale, initial_state, cu_seqlens):
    """o [B,T,H,V] and final states [N,H,K,V] (float32) by a scan over tokens."""
    B, T, H, K = k.shape
    seg = segments(B, T, cu_seqlens)

    def step(S, x):
        S, o, _, _ = delta_step(S, *x, scale)
        return S, o

    S0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    return scan_tokens(step, S0, (q, k, kw, v, beta, g), seg, initial_state)
