"""``Options.stream`` of the OSGM and ATK phases: their Mosaic kernels as calls on another XLA
GPU stream (``rows_mosaic.on_stream``). The values are those of the main stream's; the
annotation reaches both directions' calls, in interpret mode and lowered for CUDA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import _lowered_for_cuda
from pallas_kernels import atk_precond, osgm_precond, rows_mosaic
from pallas_kernels.atk_precond import atk_pallas
from pallas_kernels.osgm_precond import osgm_pallas
from test_pallas_osgm import make_inputs

ANNOTATION = '_xla_stream_annotation = "1"'
OSGM = osgm_precond.Options(picard_iters=0)  # the Mosaic kernels (K = 128)


def osgm_inputs(t=70):
    """One row, two heads, K = 128, T = 70 (a partial second tile), APF retention: (k, β, r)
    of test_pallas_osgm's inputs."""
    x = make_inputs(0, b=1, n_init=1, t=t, k_dim=128)
    return x["k"], x["beta"], x["retention"]


def osgm_loss(options, interpret=None):
    """A fixed-weight loss of OSGM's k̃ and final d (η = 1: the clip active)."""
    def loss(k, beta, r):
        kw, final = osgm_pallas(k, beta, r, 1.0, 0.5, 2.0, True, 1e-6, None, None, 64, options,
                                interpret)
        w = jnp.cos(jnp.arange(kw.size, dtype=jnp.float32)).reshape(kw.shape)
        return jnp.sum(kw * w) + jnp.sum(final ** 2)
    return loss


def test_osgm_on_a_stream_gives_the_same_bits():
    """Interpret mode: forward and the gradients of k, β, r bit for bit the main stream's, and
    the differentiated program holds the annotation (the forward's call and the backward's)."""
    x = osgm_inputs()
    on = osgm_loss(dataclasses.replace(OSGM, stream=1))
    got, want = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*x)
                 for f in (on, osgm_loss(OSGM)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    text = jax.jit(jax.grad(on, argnums=(0, 1, 2))).lower(*x).as_text()
    assert text.count("call @compute_on") >= 2 and ANNOTATION in text
    assert ANNOTATION not in jax.jit(jax.grad(osgm_loss(OSGM))).lower(*x).as_text()


def test_osgm_lowered_for_cuda_runs_its_kernels_on_the_stream():
    """Lowered for CUDA (an abstract H100; the kernels' calls through the mesh partitioning): both
    Mosaic kernels sit inside the annotated calls."""
    args = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16 if i == 0 else a.dtype)
            for i, a in enumerate(osgm_inputs(128))]
    text = _lowered_for_cuda(jax.grad(osgm_loss(dataclasses.replace(OSGM, stream=1), False),
                                      argnums=(0, 1, 2)), args)
    streamed = [f for f in text.split("\n  func.func ")
                if "custom_call @mosaic_gpu" in f and f.startswith("private @compute_on")]
    assert len(streamed) == 2, text.count("custom_call @mosaic_gpu")
    assert text.count(ANNOTATION) >= 2


def test_atk_on_a_stream_gives_the_same_bits():
    """The ATK phase's Mosaic kernels likewise (interpret mode, bf16 keys, a per-head decay)."""
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((1, 70, 2, 128)) / np.sqrt(128), jnp.bfloat16)
    gain = jnp.asarray(rng.uniform(0.05, 0.95, (1, 70, 2)), jnp.float32)
    log_decay = jnp.asarray(-rng.uniform(0.01, 0.3, (1, 70, 2)), jnp.float32)
    center = jnp.asarray(rng.uniform(-0.5, 0.1, (2,)), jnp.float32)

    def loss(options):
        def f(k, gain, log_decay, center):
            kw, final = atk_pallas(k, log_decay, gain, center, 1.5, 1e-6, None, None, 64,
                                   options)
            return jnp.sum(kw.astype(jnp.float32) * jnp.sin(kw.astype(jnp.float32))) + jnp.sum(
                final)
        return f

    x = (k, gain, log_decay, center)
    on = loss(atk_precond.Options(stream=1))
    got, want = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(*x)
                 for f in (on, loss(atk_precond.Options())))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert ANNOTATION in jax.jit(jax.grad(on)).lower(*x).as_text()


@pytest.mark.parametrize("stream", [0, -1, 1.0, True, "1"])
def test_bad_streams_raise(stream):
    for options in (osgm_precond.Options, atk_precond.Options):
        with pytest.raises(ValueError, match="Options.stream"):
            options(stream=stream)
    with pytest.raises(ValueError, match="stream"):
        rows_mosaic.on_stream(lambda x: x, stream)


def test_atk_default_options_reach_the_public_op():
    """``atk_precond.default_options``: ``atk_precondition(impl="pallas")``, as the layers call
    it, traced inside ``default_options(Options(stream=1))`` has its kernels on the stream (a
    nested None keeps the enclosing options), traced after it not; anything else is refused."""
    import precond_linattn as pla
    rng = np.random.default_rng(2)
    k = jnp.asarray(rng.standard_normal((1, 40, 2, 128)) / np.sqrt(128), jnp.bfloat16)
    gain = jnp.asarray(rng.uniform(0.05, 0.95, (1, 40, 2)), jnp.float32)
    log_decay = jnp.asarray(-rng.uniform(0.01, 0.3, (1, 40, 2)), jnp.float32)

    def lowered():
        f = lambda k: pla.atk_precondition(k, log_decay, gain, jnp.full((2,), -0.2),  # noqa: E731
                                           impl="pallas")[0]
        return jax.jit(f).lower(k).as_text()

    with atk_precond.default_options(atk_precond.Options(stream=1)):
        with atk_precond.default_options(None):
            inside = lowered()
    assert ANNOTATION in inside and ANNOTATION not in lowered()
    with pytest.raises(ValueError, match="default_options"):
        with atk_precond.default_options(osgm_precond.Options()):
            pass
