"""Language models over the attention layers: presets, sizes, decoding."""

from precond_linattn.models.config import ModelConfig
from precond_linattn.models.counting import StateBytes, abstract_model, count_params, decode_state_bytes
from precond_linattn.models.generate import generate, sample
from precond_linattn.models.lm import Block, LanguageModel, ModelCache, SwiGLU
from precond_linattn.models.presets import NOMINAL_PARAMS, PRESETS, preset

__all__ = ["Block", "LanguageModel", "ModelCache", "ModelConfig", "NOMINAL_PARAMS", "PRESETS", "StateBytes",
           "SwiGLU", "abstract_model", "count_params", "decode_state_bytes", "generate", "preset",
           "sample"]
