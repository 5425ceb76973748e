"""The LM head and the token loss as one differentiable op, the logits' gradient formed in the
forward pass.

    logits = h W   (float32 accumulation; h [..., D], W [D, V] in the compute dtype)
    nll_t  = logsumexp(logits_t) − logits_t[y_t]          summed over supervised tokens
    ∂logits = (softmax(logits) − onehot(y)) ⊙ mask       (in h's dtype)
    ∂h = g ∂logits Wᵀ,  ∂W = g hᵀ ∂logits                (g: the cotangent of the nll sum)

optax's cross-entropy on the model's float32 logits gives the same sums; autodiff through it
keeps the float32 logits for the backward (4 bytes a token and vocabulary entry), reads them
again for softmax − onehot and once more to round that for the head's bf16 matmuls (RESULTS
run 93's profile: ~3.3 ms a step at 8 x 2048 tokens and 32000 entries, the matmuls apart). Here the
forward's pass over the logits also writes ∂logits in the compute dtype, the only residual
besides h and W (2 bytes a token and entry), and the backward is the two matmuls alone.
"""

import jax
import jax.numpy as jnp

from precond_linattn.models.lm import head_pullback
from train.data import IGNORE_INDEX


def _sums(h, w, targets):
    """(nll sum, correct, count, ∂logits ⊙ mask in h's dtype) of the module docstring."""
    logits = jnp.matmul(h, w, preferred_element_type=jnp.float32)
    mask = targets != IGNORE_INDEX
    safe = jnp.where(mask, targets, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    nll = jnp.sum(jnp.where(mask, lse - picked, 0.0))
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == targets) & mask, dtype=jnp.int32)
    count = jnp.sum(mask, dtype=jnp.int32)
    onehot = jax.nn.one_hot(safe, logits.shape[-1], dtype=jnp.float32)
    dlogits = (jnp.exp(logits - lse[..., None]) - onehot) * mask[..., None]
    return nll, correct, count, dlogits.astype(h.dtype)


@jax.custom_vjp
def head_loss_sums(h, w, targets):
    """(nll, correct, count): the summed cross-entropy of the supervised tokens (targets !=
    IGNORE_INDEX) under logits = h W, how many of them the argmax gets right, and how many there
    are; h [..., D] and W [D, V] in the compute dtype, targets [...] int. Differentiable in h
    and W (module docstring)."""
    return _sums(h, w, targets)[:3]


def _fwd(h, w, targets):
    nll, correct, count, dlogits = _sums(h, w, targets)
    return (nll, correct, count), (h, w, dlogits)


def _bwd(res, cts):
    h, w, dlogits = res
    dh, dw = head_pullback(h, w, dlogits)
    return (cts[0] * dh).astype(h.dtype), (cts[0] * dw).astype(w.dtype), None


head_loss_sums.defvjp(_fwd, _bwd)
