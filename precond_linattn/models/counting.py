"""Sizes without allocation (``jax.eval_shape``): parameter counts and resident decode state.

Decode state per layer and sequence (SPEC 1): the memory S [H, K, V] and the preconditioner state,
both float32: ATK's A [H, K] (1/V of S), OSGM's d in two slots [H, 2, K] (2/V of S: the decode
step writes the next d into the spare slot in place, ``LayerCache``; the algorithm's d is K
floats a head); none for the plain backbones. Plus the convolution tails, rings of W slots
[W, 2·H·K + H·V] in the compute dtype; and once a model, the cache's int32 position a sequence.
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
    """Resident decode-state bytes: per layer (memory, preconditioner, conv tails) and model (the
    layers and the shared position)."""

    memory: int
    preconditioner: int
    conv: int
    num_layers: int
    position: int

    @property
    def per_layer(self) -> int:
        return self.memory + self.preconditioner + self.conv

    @property
    def total(self) -> int:
        return self.per_layer * self.num_layers + self.position


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def decode_state_bytes(config: ModelConfig, batch: int = 1) -> StateBytes:
    """Bytes of the decode cache for ``batch`` sequences (every layer has the same cache)."""
    cache = jax.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)).init_cache(batch))
    layer = cache.layers[0]
    return StateBytes(_nbytes(layer.memory), _nbytes(layer.precond), _nbytes(layer.conv),
                      config.num_layers, _nbytes(cache.position))
