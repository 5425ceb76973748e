"""Sizes without allocation (``jax.eval_shape``): parameter counts and resident decode state.

Decode state per layer and sequence (SPEC 1): the memory S [H, K, V] and the preconditioner state
[H, K] (d for OSGM, A for ATK; absent for the plain backbones, so OS-* / P-* add 1/V of S), both
float32, plus the convolution tails [W − 1, 2·H·K + H·V] in the compute dtype.
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from precond_linattn.models.config import ModelConfig
from precond_linattn.models.lm import LanguageModel


def abstract_model(config: ModelConfig) -> LanguageModel:
    """The model with ``jax.ShapeDtypeStruct`` leaves instead of arrays (nothing allocated)."""
    return nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))


def count_params(config: ModelConfig) -> int:
    """Number of trainable parameters (``nnx.Param`` leaves); tied embeddings count once."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract_model(config), nnx.Param)))


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Resident decode-state bytes: per layer (memory, preconditioner, conv tails) and model."""

    memory: int
    preconditioner: int
    conv: int
    num_layers: int

    @property
    def per_layer(self) -> int:
        return self.memory + self.preconditioner + self.conv

    @property
    def total(self) -> int:
        return self.per_layer * self.num_layers


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def decode_state_bytes(config: ModelConfig, batch: int = 1) -> StateBytes:
    """Bytes of the decode cache for ``batch`` sequences (every layer has the same cache)."""
    cache = jax.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)).init_cache(batch))[0]
    return StateBytes(_nbytes(cache.memory), _nbytes(cache.precond), _nbytes(cache.conv),
                      config.num_layers)
