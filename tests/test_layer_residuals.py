"""What the backward keeps of the layers' elementwise parts (the training step's memory): the
short convolution, the RMSNorms and SwiGLU's product keep their inputs, not their float32
intermediates (``jax.checkpoint``; benchmarks/NOTES.md session 16: ~1.5 GiB a block of the
340M models on the CPU)."""

import jax
import jax.numpy as jnp
from flax import nnx

from precond_linattn.layers import RMSNorm, ShortConvolution
from precond_linattn.models import preset
from precond_linattn.models.lm import SwiGLU

B, T, D = 2, 48, 32
BF16, F32 = jnp.bfloat16, jnp.float32


def activations_kept(f, *args):
    """The activation-shaped residuals ([batch, time, ...]) of f's backward with respect to
    ``args`` (the leaves of ``jax.vjp``'s pullback), as (dtype, shape)."""
    pullback = jax.vjp(f, *args)[1]
    return sorted((str(r.dtype), r.shape) for r in jax.tree_util.tree_leaves(pullback)
                  if r.ndim >= 3)


def test_short_convolution_keeps_its_input_only(rand):
    conv = ShortConvolution(D, 4, use_bias=True, dtype=BF16, param_dtype=F32, rngs=nnx.Rngs(0))
    x = rand.normal(B, T, D).astype(BF16)
    kept = activations_kept(lambda x: conv(x).astype(F32).sum(), x)
    assert kept == [("bfloat16", (B, T, D))], kept
    cu = jnp.array([0, 20, 48], jnp.int32)
    kept = activations_kept(lambda x: conv(x, cu_seqlens=cu).astype(F32).sum(), x[:1])
    assert kept == [("bfloat16", (1, T, D))], kept


def test_rms_norm_keeps_its_inputs_only(rand):
    x, g = (rand.normal(B, T, D).astype(BF16) for _ in range(2))
    plain = RMSNorm(D, eps=1e-6, dtype=BF16)
    assert activations_kept(lambda x: plain(x).astype(F32).sum(), x) == [("bfloat16", (B, T, D))]
    gated = RMSNorm(D, eps=1e-6, activation="swish", dtype=BF16)
    kept = activations_kept(lambda x, g: gated(x, g).astype(F32).sum(), x, g)
    assert kept == [("bfloat16", (B, T, D))] * 2, kept


def test_swiglu_keeps_the_projections_not_the_product(rand):
    config = preset("deltanet-340m", "none", dtype=BF16)
    mlp = SwiGLU(config, rngs=nnx.Rngs(0))
    x = rand.normal(1, 4, config.hidden_size).astype(BF16)
    kept = activations_kept(lambda x: mlp(x).astype(F32).sum(), x)
    assert kept == [("bfloat16", (1, 4, config.mlp_width))] * 2, kept  # W_gate x and W_up x
