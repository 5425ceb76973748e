"""Configuration of the language model: vocabulary, depth, the layer, and the MLP width."""

import dataclasses

from precond_linattn.layers.config import LayerConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder of ``num_layers`` pre-RMSNorm blocks (FLA's ``*ForCausalLM``):

        h ← h + Attention(RMSNorm(h));   h ← h + SwiGLU(RMSNorm(h));   logits = RMSNorm(h) W_head

    intermediate_size: SwiGLU width F; None (kept as None) derives it from hidden_ratio with FLA's
      rule, the multiple of 256 at or above int(hidden_size · hidden_ratio · 2/3): ``mlp_width``
      is the width in use, so ``dataclasses.replace(config, hidden_ratio=...)`` resizes the MLP.
    tie_embeddings: the LM head reuses the embedding matrix (logits = h Eᵀ).
    Compute and parameter dtypes are the layer's (``layer.dtype``, ``layer.param_dtype``).
    """

    vocab_size: int
    num_layers: int
    layer: LayerConfig
    hidden_ratio: int = 4
    intermediate_size: int | None = None
    tie_embeddings: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "hidden_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.layer, LayerConfig):
            raise ValueError(f"layer must be a LayerConfig, got {type(self.layer).__name__}")
        if self.intermediate_size is not None and (not isinstance(self.intermediate_size, int)
                                                   or self.intermediate_size < 1):
            raise ValueError(f"intermediate_size must be a positive int, got {self.intermediate_size!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def mlp_width(self) -> int:
        """F: ``intermediate_size``, or when None 256 · ⌈int(hidden_size · hidden_ratio · 2/3) / 256⌉."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 256 * -(-int(self.hidden_size * self.hidden_ratio * 2 / 3) // 256)
