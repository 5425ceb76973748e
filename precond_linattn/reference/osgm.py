"""The OSGM / OSDN preconditioner of SPEC 3.1, one token at a time (float32 state).

With s_t = k_t ⊙ k_t, n̄_t = max(‖k_t‖², ε), g_t = β_t (beta-aware) or 1 (beta-free):

    k̃_t     = d_t ⊙ k_t                                      (emitted with the OLD d_t)
    d_{t+1}  = clip(r_t d_t + (η g_t / n̄_t)(1 − g_t ⟨d_t, s_t⟩) s_t, d_min, d_max)

r_t is the retention (APF; 1 for vanilla OSDN); d_1 = the initial state (ones by default), which
is not clipped. The clip's derivative is taken as 0 where the pre-clip value lies exactly on a
bound (a coordinate on a bound stays pinned there), the convention the chunked form shares.
"""

import jax.numpy as jnp

from precond_linattn.reference.delta import scan_tokens
from precond_linattn.varlen import segments


def clip_box(x, d_min, d_max):
    """clip(x, d_min, d_max) with derivative 0 on the bounds (and beyond), 1 strictly inside."""
    return jnp.where(x >= d_max, d_max, jnp.where(x <= d_min, d_min, x))


def osgm_step_fn(d, k, beta, r, eta, d_min, d_max, beta_aware, eps):
    """One token for all rows: d, k [B, H, K]; beta [B, H]; r [B, H] or None (r ≡ 1).

    Returns (k̃_t = d_t ⊙ k_t, d_{t+1})."""
    s = k * k
    n = jnp.maximum(jnp.sum(s, axis=-1), eps)
    g = beta if beta_aware else jnp.ones_like(beta)
    u = eta * g / n * (1.0 - g * jnp.sum(d * s, axis=-1))  # a sum, not a dot: also in kernels
    kept = d if r is None else r[..., None] * d
    return d * k, clip_box(kept + u[..., None] * s, d_min, d_max)


def osgm_reference(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state,
                   cu_seqlens):
    """k̃ [B, T, H, K] and final states d [N, H, K] (float32) by a scan over tokens.

    k [B, T, H, K]; beta, retention [B, T, H] (retention None: r ≡ 1);
    initial_state [N, H, K] or None (ones)."""
    B, T, H, K = k.shape
    seg = segments(B, T, cu_seqlens)
    if initial_state is None:
        initial_state = jnp.ones((seg.num_docs, H, K), jnp.float32)

    def step(d, inp):
        k_write, d = osgm_step_fn(d, *inp, eta, d_min, d_max, beta_aware, eps)
        return d, k_write

    d0 = jnp.zeros((B, H, K), jnp.float32)
    return scan_tokens(step, d0, (k, beta, retention), seg, initial_state)
