"""Decay-weighted causal Gram matrices inside a chunk, without overflow.

    G_ij = Σ_k X_ik Y_jk exp(γ_ik − γ_jk)   for i > j (strict) or i ≥ j, else 0

γ is the cumulative log decay from the chunk start: None (no decay), [..., C] (scalar per token)
or [..., C, K] (per channel). γ is non-increasing, so every exponent used is ≤ 0. For the
per-channel case the ratio cannot be split as (X ⊙ e^γ)(Y ⊙ e^−γ)ᵀ without overflow; instead the
chunk is cut into sub-blocks of 16 rows: off-diagonal blocks (I > J) factor through the first row
of block I (both factors ≤ 1), diagonal blocks use the exact [16, 16, K] exponent tensor.

Exponents that are 0 whatever γ is (the diagonal's γ_i − γ_i, a reference row's own factor) are
set to 0 rather than formed: their two gradients would cancel only to rounding, which is all of
dγ where a chunk decays away.
"""

import jax.numpy as jnp

from precond_linattn.numerics import einsum

SUB_BLOCK = 16


def causal_mask(c: int, strict: bool):
    i = jnp.arange(c)
    return i[:, None] > i[None, :] if strict else i[:, None] >= i[None, :]


def decayed_gram(X, Y, gamma, strict: bool):
    """G [..., C, C] as in the module docstring; X, Y [..., C, K]."""
    c = X.shape[-2]
    mask = causal_mask(c, strict)
    if gamma is None:
        return jnp.where(mask, einsum("...ik,...jk->...ij", X, Y), 0.0)
    if gamma.ndim == X.ndim - 1:
        diff = jnp.where(jnp.eye(c, dtype=bool), 0.0, gamma[..., :, None] - gamma[..., None, :])
        return einsum("...ik,...jk->...ij", X, Y) * jnp.exp(jnp.where(mask, diff, -jnp.inf))
    return _vector_gram(X, Y, gamma, strict)


def _vector_gram(X, Y, gamma, strict):
    *lead, c, k = X.shape
    s = SUB_BLOCK if c % SUB_BLOCK == 0 else c
    nb = c // s
    Xb, Yb, Gb = (a.reshape(*lead, nb, s, k) for a in (X, Y, gamma))
    ref = Gb[..., :, 0, :]  # [.., nb, K]: γ at the first row of each block
    blocks = jnp.arange(nb)
    below = blocks[:, None] > blocks[None, :]  # I > J
    Xs = Xb * jnp.exp((Gb - ref[..., :, None, :]).at[..., 0, :].set(0.0))
    expo = ref[..., :, None, None, :] - Gb[..., None, :, :, :]  # [.., I, J, s, K]
    Ys = Yb[..., None, :, :, :] * jnp.exp(jnp.where(below[:, :, None, None], expo, -jnp.inf))
    off = einsum("...isk,...ijtk->...ijst", Xs, Ys)
    inner = causal_mask(s, strict)
    d = Gb[..., :, :, None, :] - Gb[..., :, None, :, :]  # [.., I, s, s, K]
    d = jnp.where(jnp.eye(s, dtype=bool)[:, :, None], 0.0, d)
    E = jnp.exp(jnp.where(inner[:, :, None], d, -jnp.inf))
    diag = einsum("...iak,...ibk,...iabk->...iab", Xb, Yb, E)
    eye = (blocks[:, None] == blocks[None, :])[:, :, None, None]
    G = off + jnp.where(eye, diag[..., :, None, :, :], 0.0)  # [.., I, J, s, s]
    return jnp.swapaxes(G, -3, -2).reshape(*lead, c, c)
