"""Numerical conventions: every state and accumulation is float32 at full precision."""

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
STATE_DTYPE = jnp.float32
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def einsum(spec: str, *operands):
    """``jnp.einsum`` at float32 ``Precision.HIGHEST`` (no TF32 / bf16 passes on GPU)."""
    return jnp.einsum(spec, *operands, precision=HIGHEST, preferred_element_type=jnp.float32)


def f32(x):
    """Cast to float32 (None passes through)."""
    return None if x is None else jnp.asarray(x, jnp.float32)
