"""``partition.lowered_once`` (and ``decode_step``'s own ``jit``): a program that calls an op in
several layers (same config, same shapes) lowers the op's kernels once, forward and backward, not
once a call site. Lowered for CUDA on this CPU (an abstract H100 mesh; the Triton kernels, as the
Mosaic ones need a Hopper device to be chosen; K = 64 also takes OSGM's Triton kernels): three
chained calls hold as many kernels as one. The chains start from intermediates, as a model's
layers do: a first call on the program's own arguments was lowered apart from the later ones here
(one more copy, not one a layer; same jaxpr and parameters, the cause not found)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.atk_precond import Options as ATKOptions
from pallas_kernels.atk_precond import atk_pallas
from pallas_kernels.decode_step import OSGMStep, decode_step
from pallas_kernels.delta_rule import delta_rule_pallas
from pallas_kernels.osgm_precond import osgm_pallas
from conftest import triton_kernels_lowered_for_cuda

B, T, H, K = 2, 100, 2, 64


def delta(x, beta, g):
    """A delta core whose output is its next call's input (``K == V``)."""
    return delta_rule_pallas(x, x, x, x, beta, g, 1.0, None, None, 64, interpret=False)[0]


def osgm(x, beta, g):
    return osgm_pallas(x, beta, beta, 0.003, 0.5, 2.0, True, 1e-6, None, None, 64, interpret=False)[0]


def atk(x, beta, g):
    return atk_pallas(x, g, beta, jnp.zeros((H,)), 1.5, 1e-6, None, None, 64,
                      ATKOptions(mosaic=False), interpret=False)[0]


@pytest.mark.parametrize("op", [delta, osgm, atk])
def test_repeated_calls_lower_once(op):
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((B, T, H, K), jnp.bfloat16), ((B, T, H), jnp.bfloat16), ((B, T, H), jnp.float32))]

    def layers(n):
        def loss(x, beta, g):
            x = 2 * x
            for _ in range(n):
                x = op(x, beta, g)
            return jnp.sum(x.astype(jnp.float32) ** 2)
        return loss

    once = triton_kernels_lowered_for_cuda(layers(1), args)
    assert once > 0
    assert triton_kernels_lowered_for_cuda(layers(3), args) == once


def test_decode_steps_lower_once():
    """A decoding token through three layers (each layer's output its next one's value, the
    OSGM preconditioner on) holds one decode_step kernel."""
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct(shape, f32) for shape in ((B, H, K), (B, H), (B, H, K, K))]

    def layers(x, beta, state):
        x, state, d = 2 * x, 2 * state, jnp.ones_like(x)  # intermediates, as a model's
        for _ in range(3):
            x, state, d = decode_step(x, x, x, beta, state, osgm=OSGMStep(d, 0.5, 0.1, 2.0),
                                      interpret=False)
        return x, state, d

    assert triton_kernels_lowered_for_cuda(layers, args, grad=False) == 1
