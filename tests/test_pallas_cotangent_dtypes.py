"""Each Pallas op's gradients come in their inputs' dtypes (bf16 inputs, a float32 initial
state), on every backward path: a kernel's float32 cotangent for a bf16 input passed through
``custom_vjp`` unnoticed until an input used twice (β by OSGM and the delta core) summed a
float32 and a bf16 cotangent and JAX refused (run 110). Shapes only: ``jax.eval_shape``."""

import jax
import jax.numpy as jnp
import pytest

import precond_linattn as pla
from pallas_kernels.delta_rule import Options, delta_rule_pallas

B, T, H, K, V = 1, 70, 2, 128, 64
BF = jnp.bfloat16


def assert_grads_in_input_dtypes(f, args):
    """The gradient of sum(f(*args)) w.r.t. every argument has that argument's dtype."""
    def loss(*a):
        return sum(jnp.sum(y.astype(jnp.float32)) for y in jax.tree.leaves(f(*a)))

    grads = jax.eval_shape(jax.grad(loss, argnums=tuple(range(len(args)))), *args)
    for i, (a, g) in enumerate(zip(args, grads)):
        assert g.dtype == a.dtype, (i, a.dtype, g.dtype)


def spec(*shape, dtype=BF):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("options", [
    Options(), Options(serial_backend="mosaic", fused_grads=False),
    Options(serial_backend="mosaic", fused_grads=True, wy_in_serial=False),
    Options(serial_backend="mosaic", fused_grads=True)], ids=["default", "mosaic", "fused", "fused-wy"])
def test_delta_rule_gradients_in_input_dtypes(options):
    args = (spec(B, T, H, K), spec(B, T, H, K), spec(B, T, H, K), spec(B, T, H, V), spec(B, T, H),
            spec(B, T, H), spec(B, H, K, V, dtype=jnp.float32))

    def f(q, k, kw, v, beta, g, s0):
        return delta_rule_pallas(q, k, kw, v, beta, g, K ** -0.5, s0, None, 64, options)

    assert_grads_in_input_dtypes(f, args)


def test_osgm_gradients_in_input_dtypes():
    args = (spec(B, T, H, K), spec(B, T, H), spec(B, T, H), spec(B, H, K, dtype=jnp.float32))

    def f(k, beta, r, d0):
        return pla.osgm_precondition(k, beta, retention=r, initial_state=d0,
                                     output_final_state=True, impl="pallas")

    assert_grads_in_input_dtypes(f, args)


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_atk_gradients_in_input_dtypes(decay):
    g = spec(B, T, H) if decay == "scalar" else spec(B, T, H, K)
    args = (spec(B, T, H, K), g, spec(B, T, H), spec(H, dtype=jnp.float32),
            spec(B, H, K, dtype=jnp.float32))

    def f(k, g, gain, center, a0):
        return pla.atk_precondition(k, g, gain, center, initial_state=a0, output_final_state=True,
                                    impl="pallas")

    assert_grads_in_input_dtypes(f, args)
