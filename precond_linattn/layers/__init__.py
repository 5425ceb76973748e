"""Flax NNX layers: the preconditioned delta-rule attention of all twelve variants."""

from precond_linattn.layers.attention import LayerCache, PrecondDeltaAttention
from precond_linattn.layers.config import (
    ATKConfig, BACKBONES, LayerConfig, OSGMConfig, PRECONDITIONERS, VARIANT_NAMES)
from precond_linattn.layers.conv import ShortConvolution
from precond_linattn.layers.norm import RMSNorm

__all__ = ["ATKConfig", "BACKBONES", "LayerCache", "LayerConfig", "OSGMConfig", "PRECONDITIONERS",
           "PrecondDeltaAttention", "RMSNorm", "ShortConvolution", "VARIANT_NAMES"]
