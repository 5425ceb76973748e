"""The ATK / PDN preconditioner (SPEC 3.2) in chunked form, pure JAX, differentiable.

The A-recurrence is linear and elementwise. Per document-aligned chunk of C tokens, with γ the
cumulative log decay from the chunk start (per head, or per channel) and w_j = gain_j (k_j ⊙ k_j):

    A_t = exp(γ_t) ⊙ A_0 + Σ_{j≤t} exp(γ_t − γ_j) ⊙ w_j

The sum is one product with the masked decay matrix D_tj = exp(γ_t − γ_j) (t ≥ j, else 0), built
with the exponent masked before exp, so every exponent is ≤ 0 and nothing overflows: [C, C] per
head for scalar decay, [C, C, K] for per-channel decay. Only A_0 → A_C is a scan over chunks;
the squash to k̃ is elementwise afterwards. Padding slots (k = 0, gain = 0, g = 0) leave A as is.
"""

import jax
import jax.numpy as jnp

from precond_linattn.chunked.gram import causal_mask
from precond_linattn.numerics import einsum
from precond_linattn.reference.atk import atk_squash
from precond_linattn.varlen import chunk_layout, from_chunks, reset, to_chunks


def _within_chunk(w, gamma):
    """Σ_{j≤i} exp(γ_i − γ_j) ⊙ w_j for w [B, NC, C, H, K] and γ [B, NC, C, H] or [.., H, K]."""
    c = w.shape[2]
    mask = causal_mask(c, strict=False).reshape(c, c, *(1,) * (gamma.ndim - 3))
    D = jnp.exp(jnp.where(mask, gamma[:, :, :, None] - gamma[:, :, None, :], -jnp.inf))
    spec = "bnijh,bnjhk->bnihk" if gamma.ndim == w.ndim - 1 else "bnijhk,bnjhk->bnihk"
    return einsum(spec, D, w)


def atk_chunked(k, g, gain, center, x, eps, initial_state, cu_seqlens, chunk_size):
    """k̃ [B, T, H, K] and final states A [N, H, K] (float32); arguments as ``atk_reference``."""
    B, T, H, K = k.shape
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    kc = to_chunks(k, layout)  # [B, NC, C, H, K]
    w = to_chunks(gain, layout)[..., None] * (kc * kc)
    gamma = jnp.cumsum(to_chunks(g, layout), axis=2)
    intra = _within_chunk(w, gamma)
    Gam = jnp.exp(gamma if gamma.ndim == w.ndim else gamma[..., None])  # [B, NC, C, H, 1|K]

    def body(A, inp):
        Gam_C, intra_C, doc, first = inp
        A = reset(A, initial_state, doc, first)
        return Gam_C * A + intra_C, A

    xs = (jnp.moveaxis(Gam[:, :, -1], 1, 0), jnp.moveaxis(intra[:, :, -1], 1, 0),
          layout.doc.T, layout.first.T)
    _, A_pre = jax.lax.scan(body, jnp.zeros((B, H, K), jnp.float32), xs)
    A = Gam * jnp.moveaxis(A_pre, 0, 1)[:, :, None] + intra  # [B, NC, C, H, K]
    k_write = from_chunks(atk_squash(A, kc, center, x, eps), layout)
    return k_write, A[layout.final_row, layout.final_chunk, -1]
