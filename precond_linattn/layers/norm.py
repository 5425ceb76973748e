"""RMSNorm with an optional output gate (FLA's ``RMSNorm`` and ``FusedRMSNormGated``).

    y = x / sqrt(mean(x²) + eps) ⊙ scale                 (no gate)
    y = x / sqrt(mean(x²) + eps) ⊙ scale ⊙ act(g)        act = SiLU ("swish") or sigmoid

over the last axis, computed in float32 and returned in the compute dtype. Used per head before
the output projection (x, g [..., H, V], scale [V]) and as the blocks' pre-norms (scale [D]).
"""

import jax
import jax.numpy as jnp
from flax import nnx

GATE_ACTIVATIONS = {"swish": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


class RMSNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, activation: str | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        if activation is not None and activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation must be None or one of {tuple(GATE_ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.eps, self.activation, self.dtype = eps, activation, dtype

    def __call__(self, x, gate=None):
        """y = x / sqrt(mean(x²) + eps) ⊙ scale [⊙ act(gate)], in float32, cast to ``dtype``.
        Under ``jax.checkpoint``: the backward keeps x and the gate, not the float32
        intermediates (~0.26 GiB a block of the 340M models, benchmarks/NOTES.md session 16)."""
        if (gate is None) != (self.activation is None):
            raise ValueError("a gate is required exactly when the norm has an activation")

        @jax.checkpoint
        def norm(x, scale, gate):
            x = x.astype(jnp.float32)
            y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
            y = y * scale.astype(jnp.float32)
            if gate is not None:
                y = y * GATE_ACTIVATIONS[self.activation](gate.astype(jnp.float32))
            return y.astype(self.dtype)

        return norm(x, self.scale[...], gate)
