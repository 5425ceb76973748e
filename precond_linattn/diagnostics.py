"""The residual-ratio diagnostic of the OSDN paper (SPEC section 5).

For every token and head, with f_t(S) = ½‖Sᵀk_t − v_t‖² and S̄_{t−1} the decayed state,

    q_t = f_t(S_t) / f_t(S̄_{t−1})

measured by running the delta core token by token in float32. Tokens whose pre-write residual
u_t = v_t − S̄_{t−1}ᵀk_t is numerically zero are masked (0/0 is not an observation). For the
delta rule q_t = (1 − β_t⟨k̃_t, k_t⟩)² whenever u_t ≠ 0; the measurement does not assume it.
"""

import jax.numpy as jnp

from precond_linattn.numerics import einsum, f32
from precond_linattn.reference.delta import delta_step, scan_tokens
from precond_linattn.varlen import segments


def residual_ratio(k, v, beta, *, write_key=None, log_decay=None, initial_state=None,
                   cu_seqlens=None, rtol=1e-6):
    """Per-token residual ratios.

    Args: as ``delta_rule`` (k, write_key [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; log_decay None,
      [B,T,H] or [B,T,H,K]; initial_state [N,H,K,V]); rtol: a residual is zero when
      ‖u_t‖ <= rtol · (‖v_t‖ + ‖S̄ᵀk_t‖).
    Returns: (ratio [B,T,H] float32, NaN where masked; mask [B,T,H], True where observed).
    """
    B, T, H, K = k.shape
    kw = k if write_key is None else write_key

    def step(S, x):
        k_t, v_t = x[0], x[2]
        S_new, _, u, S_bar = delta_step(S, k_t, k_t, *x[1:], 1.0)
        after = einsum("bhkv,bhk->bhv", S_new, k_t) - v_t
        read = einsum("bhkv,bhk->bhv", S_bar, k_t)
        norm_u = jnp.linalg.norm(u, axis=-1)
        observed = norm_u > rtol * (jnp.linalg.norm(v_t, axis=-1) + jnp.linalg.norm(read, axis=-1))
        ratio = jnp.sum(after**2, -1) / jnp.where(observed, norm_u**2, 1.0)
        return S_new, (jnp.where(observed, ratio, jnp.nan), observed)

    S0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    xs = (f32(k), f32(kw), f32(v), f32(beta), f32(log_decay))
    (ratio, mask), _ = scan_tokens(step, S0, xs, segments(B, T, cu_seqlens), f32(initial_state))
    return ratio, mask


def ratio_summary(ratio, mask):
    """(q_geo, q_arith) = (exp mean log q_t, mean q_t) over observed tokens."""
    n = jnp.maximum(mask.sum(), 1)
    safe = jnp.where(mask, ratio, 1.0)
    return jnp.exp(jnp.sum(jnp.log(jnp.maximum(safe, 1e-30))) / n), jnp.sum(jnp.where(mask, ratio, 0)) / n
