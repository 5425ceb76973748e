"""The language model: embeddings, pre-RMSNorm blocks (attention + SwiGLU MLP), final norm, head.

    h_0 = E[tokens]  (residual stream in float32)
    h ← h + Attention(RMSNorm(h));   h ← h + W_down (SiLU(W_gate RMSNorm(h)) ⊙ W_up RMSNorm(h))
    logits = RMSNorm(h) W_head   (W_head = Eᵀ when tied), float32

Names follow FLA (``model.`` prefix dropped): embeddings, layers.{i}.{attn_norm, attn, mlp_norm,
mlp.{gate,up,down}_proj}, norm, lm_head; FLA's ``embeddings.weight`` is ``embeddings.embedding``,
an RMSNorm ``weight`` is ``scale`` and a linear ``weight`` is ``kernel`` (transposed).

Three ways to run it, all through the same ops: ``__call__`` (full sequence, training),
``prefill`` (full sequence, returns the last logits of every row / document and the decode
cache) and ``step`` (one token per row, O(1) in the length).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from precond_linattn._typing import Array, Float, Int
from precond_linattn.layers.attention import LayerCache, PrecondDeltaAttention
from precond_linattn.layers.init import normal
from precond_linattn.layers.norm import RMSNorm
from precond_linattn.models.config import ModelConfig


class ModelCache(NamedTuple):
    """The decode cache of a model: one ``LayerCache`` a layer, without its position, and the one
    position all layers share (a position a layer would be one more carried counter and one more
    small kernel a layer a step in a decoding loop)."""

    layers: tuple[LayerCache, ...]  # position None
    position: Int[Array, " n"]

    def ordered(self):
        """Every layer's ``LayerCache.ordered`` contents (independent of the position)."""
        return tuple(c._replace(position=self.position).ordered() for c in self.layers)


def _model_cache(caches) -> ModelCache:
    """The layers' caches (all at one position) as a ``ModelCache``."""
    return ModelCache(tuple(c._replace(position=None) for c in caches), caches[0].position)


@jax.custom_vjp
def head_logits(h, w):
    """logits = h W with float32 accumulation, h [..., D] and W [D, N] in the compute dtype. The
    backward rounds the float32 cotangent to that dtype before its two products (∂h = g Wᵀ,
    ∂W = hᵀ g), as autocast does: left to autodiff, a float32 cotangent turns both into float32
    matmuls (TF32 on the GPU), which cost ~6.6 ms a step of the 340M models, the forward's 4x
    (benchmarks/NOTES.md, session 18)."""
    return jnp.matmul(h, w, preferred_element_type=jnp.float32)


def _head_fwd(h, w):
    return head_logits(h, w), (h, w)


def head_pullback(h, w, g):
    """(g Wᵀ, hᵀ g) in float32 accumulation for the head's input h [..., D], weight W [D, N]
    and a cotangent g [..., N] of the logits, all three in the compute dtype."""
    dh = jnp.matmul(g, w.T, preferred_element_type=jnp.float32)
    dw = jnp.einsum("...d,...n->dn", h, g, preferred_element_type=jnp.float32)
    return dh, dw


def _head_bwd(res, g):
    h, w = res
    dh, dw = head_pullback(h, w, g.astype(h.dtype))
    return dh.astype(h.dtype), dw.astype(w.dtype)


head_logits.defvjp(_head_fwd, _head_bwd)


def _linear(i, o, c, rngs):
    return nnx.Linear(i, o, use_bias=False, dtype=c.layer.dtype, param_dtype=c.layer.param_dtype,
                      kernel_init=normal, rngs=rngs)


def _norm(c):
    return RMSNorm(c.hidden_size, eps=c.norm_eps, dtype=c.layer.dtype, param_dtype=c.layer.param_dtype)


class SwiGLU(nnx.Module):
    """y = W_down (SiLU(W_gate x) ⊙ W_up x); the backward keeps the two projections and
    recomputes the product (``jax.checkpoint``: ~0.17 GiB less a block of the 340M models,
    benchmarks/NOTES.md session 16)."""

    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
        D, F = c.hidden_size, c.mlp_width
        self.gate_proj, self.up_proj = _linear(D, F, c, rngs), _linear(D, F, c, rngs)
        self.down_proj = _linear(F, D, c, rngs)

    def __call__(self, x):
        product = jax.checkpoint(lambda gate, up: jax.nn.silu(gate) * up)
        return self.down_proj(product(self.gate_proj(x), self.up_proj(x)))


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm, self.attn = _norm(c), PrecondDeltaAttention(c.layer, rngs=rngs)
        self.mlp_norm, self.mlp = _norm(c), SwiGLU(c, rngs=rngs)

    def _mlp(self, h):
        return h + self.mlp(self.mlp_norm(h)).astype(jnp.float32)

    def __call__(self, h, *, cu_seqlens=None):
        return self._mlp(h + self.attn(self.attn_norm(h), cu_seqlens=cu_seqlens).astype(jnp.float32))

    def prefill(self, h, *, cu_seqlens=None):
        y, cache = self.attn.prefill(self.attn_norm(h), cu_seqlens=cu_seqlens)
        return self._mlp(h + y.astype(jnp.float32)), cache

    def step(self, h, cache):
        y, cache = self.attn.step(self.attn_norm(h), cache)
        return self._mlp(h + y.astype(jnp.float32)), cache


class LanguageModel(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embeddings = nnx.Embed(c.vocab_size, c.hidden_size, dtype=jnp.float32,
                                    param_dtype=c.layer.param_dtype, embedding_init=normal, rngs=rngs)
        self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
        self.norm = _norm(c)
        self.lm_head = None if c.tie_embeddings else _linear(c.hidden_size, c.vocab_size, c, rngs)

    def head_weight(self):
        """W_head [D, vocab] in the compute dtype (Eᵀ when tied)."""
        w = self.embeddings.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
        return w.astype(self.config.layer.dtype)

    def logits(self, h):
        """Logits (float32) of the final hidden states h [..., D]: RMSNorm(h) W_head."""
        return head_logits(self.norm(h), self.head_weight())

    def features(self, tokens: Int[Array, "b t"], *, cu_seqlens=None,
                 run_blocks=None) -> Float[Array, "b t d"]:
        """RMSNorm(h) [B, T, D] after the last block, in the compute dtype: the head's input
        (``train.head_loss`` takes it with ``head_weight``); arguments as ``__call__``'s."""
        h = self.embeddings(tokens)
        if run_blocks is not None:
            return self.norm(run_blocks(self.layers, h, cu_seqlens))
        for block in self.layers:
            h = block(h, cu_seqlens=cu_seqlens)
        return self.norm(h)

    def __call__(self, tokens: Int[Array, "b t"], *, cu_seqlens=None,
                 run_blocks=None) -> Float[Array, "b t v"]:
        """Logits [B, T, vocab] (float32); ``cu_seqlens`` (B = 1): packed documents.

        run_blocks(layers, h, cu_seqlens) -> h replaces the loop ``h = block(h, cu_seqlens=...)``
        over the blocks (a hook for training: parameter gathers, rematerialisation, a scan)."""
        return head_logits(self.features(tokens, cu_seqlens=cu_seqlens, run_blocks=run_blocks),
                           self.head_weight())

    def prefill(self, tokens: Int[Array, "b t"], *, cu_seqlens=None):
        """(logits [N, vocab] after the last token of every row / document, cache).

        The cache is a ``ModelCache`` with N rows, ready for ``step``; with ``cu_seqlens`` the
        packed prompts become N independent rows."""
        h = self.embeddings(tokens)
        caches = []
        for block in self.layers:
            h, cache = block.prefill(h, cu_seqlens=cu_seqlens)
            caches.append(cache)
        last = h[:, -1] if cu_seqlens is None else h[0, jnp.asarray(cu_seqlens)[1:] - 1]
        return self.logits(last), _model_cache(caches)

    def step(self, token: Int[Array, " b"], cache: ModelCache):
        """One token per row: (logits [B, vocab] float32, the updated cache)."""
        if not isinstance(cache, ModelCache):
            raise ValueError(f"cache must be the ModelCache of prefill / init_cache, got "
                             f"{type(cache).__name__}")
        h = self.embeddings(token)
        caches = []
        for block, layer_cache in zip(self.layers, cache.layers, strict=True):
            h, layer_cache = block.step(h, layer_cache._replace(position=cache.position))
            caches.append(layer_cache)
        return self.logits(h), _model_cache(caches)

    def init_cache(self, batch: int) -> ModelCache:
        """The decode cache before any token (a ``ModelCache``)."""
        return _model_cache([block.attn.init_cache(batch) for block in self.layers])
