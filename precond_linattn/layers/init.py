"""FLA-style initialisation (``FLAPreTrainedModel._init_weights`` and the layers' own inits).

- every linear / convolution kernel and the embeddings: N(0, 0.02²); biases 0; norm scales 1;
- decay rates ``A_log = log(A)``, A ~ U(lower, 16) (lower 0 for GDN-style heads, 1 for KDA);
- ``dt_bias = softplus⁻¹(dt)``, log dt ~ U(log 1e-3, log 0.1), dt clamped below at 1e-4, so
  that softplus(0 + dt_bias) = dt at init.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

INITIALIZER_RANGE = 0.02
normal = nnx.initializers.normal(INITIALIZER_RANGE)


def a_log_init(lower: float):
    """log A with A ~ U(lower, 16); A is floored at 1e-4 so that log A is finite."""

    def init(key, shape, dtype=jnp.float32):
        return jnp.log(jnp.maximum(jax.random.uniform(key, shape, dtype, lower, 16.0), 1e-4))

    return init


def dt_bias_init(key, shape, dtype=jnp.float32):
    """softplus⁻¹(dt) = dt + log(−expm1(−dt)), log dt ~ U(log 1e-3, log 0.1), dt >= 1e-4."""
    log_dt = jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(0.1))
    dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))
