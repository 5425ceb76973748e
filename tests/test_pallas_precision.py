"""The kernels' 16-bit fast paths (``Options.parallel_precision`` bf16 dots, ``state_dtype``,
``wy_dtype`` and ``serial_precision``), checked against the float32 token-by-token reference
with FLA's bars in interpret mode on CPU, where the rounding of the operands and the stored
tensors to bf16 is reproduced (and "tf32" dots are exact float32)."""

import functools

import jax
import jax.numpy as jnp
import pytest

import precond_linattn as pla
from benchmarks.fp32_record import rel_rms
from pallas_kernels.delta_rule import Options, delta_rule_pallas, resolve
from pallas_kernels.triton_common import Dots
from conftest import packed_cu_seqlens

B, T, H, K, V = 2, 150, 2, 32, 48  # T: two full chunks of 64 and a tail; V padded to 64


def outputs_and_grads(f, x, key):
    """(o, final, gradients of x) of ``f(x) -> (o, final)`` for random cotangents."""
    (o, final), pullback = jax.vjp(f, x)
    ko, kf = jax.random.split(key)
    cts = (jax.random.normal(ko, o.shape, o.dtype), jax.random.normal(kf, final.shape))
    return o, final, pullback(cts)[0]


def kernel_runs(rand, decay, seed, *options, K=K):
    """(o, final, gradients) for random cotangents of the kernel under each of ``options`` and
    of the float32 token-by-token reference (last), on bf16 inputs with an initial state."""
    x = rand.delta_inputs(B, T, H, K, V, decay=decay, dtype=jnp.bfloat16)
    x = {n: a for n, a in x.items() if a is not None}
    x["s0"] = rand.normal(B, H, K, V)

    def kernel(options, x):
        return delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"],
                                 x.get("log_decay"), K ** -0.5, x["s0"], None, 64, options)

    def reference(x):
        return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["write_key"],
                              log_decay=x.get("log_decay"), initial_state=x["s0"],
                              output_final_state=True, impl="reference")

    key = jax.random.key(seed)
    fs = [functools.partial(kernel, o) for o in options] + [reference]
    return [jax.jit(functools.partial(outputs_and_grads, f))(x, key) for f in fs]


def packed_runs(x, cu, chunk, *options):
    """(o, finals, gradients) of the op under each of ``options`` and of the float32 reference
    (last) on ``x`` (``delta_inputs`` and per-document initial states ``s0``) packed as the
    documents ``cu``, in chunks of ``chunk``."""
    K = x["k"].shape[-1]

    def kernel(options, x):
        return delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"],
                                 x["log_decay"], K ** -0.5, x["s0"], cu, chunk, options)

    def reference(x):
        return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["write_key"],
                              log_decay=x["log_decay"], initial_state=x["s0"], cu_seqlens=cu,
                              output_final_state=True, impl="reference")

    key = jax.random.key(3)
    fs = [functools.partial(kernel, o) for o in options] + [reference]
    return [jax.jit(lambda x, f=f: outputs_and_grads(f, x, key))(x) for f in fs]


def packed_documents_runs(rand, options):
    """``packed_runs`` of ``options`` on three packed documents (64, 1 and 85 tokens: a
    one-token document, a chunk-unaligned boundary and so one chunk of layout padding after the
    last, which the backward meets before any document's end) with per-document initial states
    and a scalar decay, bf16 inputs, chunks of 64."""
    T, H, K, V = 150, 2, 64, 64
    x = rand.delta_inputs(1, T, H, K, V, decay="scalar", dtype=jnp.bfloat16)
    x["s0"] = rand.normal(3, H, K, V)
    return packed_runs(x, packed_cu_seqlens([64, 1, 85]), 64, options)


def assert_within_fla_bars(got, ref):
    """Outputs and final state within 6e-3, every gradient within 8e-3 (relative RMS)."""
    assert rel_rms(got[0], ref[0]) <= 6e-3 and rel_rms(got[1], ref[1]) <= 6e-3
    for name in ref[2]:
        assert rel_rms(got[2][name], ref[2][name]) <= 8e-3, name


@pytest.mark.heavy
@pytest.mark.parametrize("decay", [None, "scalar"])
def test_bf16_parallel_dots_within_fla_bars(rand, decay):
    """bf16 inputs: the default resolves to bf16 parallel dots; outputs, final state and every
    gradient within FLA's bf16 bars (relative RMS 6e-3 / 8e-3) of the float32 token-by-token
    reference, and different from float32 parallel dots (the option reaches the kernels: the
    gradients move by more than 1e-4). ``wy_dtype="bfloat16"`` (W, U, K̃', Q', P stored in
    bf16 by ``wy_fwd``) and ``serial_precision="bf16"`` (the state and R rounded to bf16 at the
    serial passes' dots) within the bars too, their final states moved (the options are used)."""
    assert resolve(Options(), sixteen_bit=True).parallel_precision == "bf16"
    default, exact, *bf16_options, ref = kernel_runs(
        rand, decay, 3, Options(), Options(parallel_precision="tf32"),
        Options(wy_dtype="bfloat16"), Options(serial_precision="bf16"))
    assert_within_fla_bars(default, ref)
    assert max(rel_rms(default[2][n], exact[2][n]) for n in ref[2]) > 1e-4
    for got in bf16_options:
        assert_within_fla_bars(got, ref)
        assert rel_rms(got[1], default[1]) > 1e-4


@pytest.mark.heavy
def test_bf16_state_storage_within_fla_bars(rand):
    """bf16 inputs: the default stores the per-chunk states, R, dR and dO products in bf16 (it
    resolves to ``state_dtype="bfloat16"``); per-channel decay: outputs, final state and every
    gradient within FLA's bars of the float32 token-by-token reference and close to float32
    storage (the parallel kernels round those tensors at their bf16 dots already; the serial backward
    adds its dO products in bf16), yet not equal to it (the option reaches the kernels).
    ``wy_dtype="bfloat16"`` from ``wy_vector_fwd`` or cast from the plain-JAX WY step
    (``vector_wy="xla"``) within the bars too, final state moved."""
    assert resolve(Options(), sixteen_bit=True).state_dtype == "bfloat16"
    default, full, *wy16, ref = kernel_runs(
        rand, "vector", 5, Options(), Options(state_dtype="float32"),
        Options(wy_dtype="bfloat16"), Options(wy_dtype="bfloat16", vector_wy="xla"))
    assert_within_fla_bars(default, ref)
    diffs = [rel_rms(default[2][name], full[2][name]) for name in ref[2]]
    assert max(diffs) <= 4e-3 and max(diffs) > 1e-5, diffs
    for got in wy16:
        assert_within_fla_bars(got, ref)
        assert rel_rms(got[1], default[1]) > 1e-4


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        Dots("fp16")
    with pytest.raises(ValueError, match="Options.state_dtype"):
        Options(state_dtype="float16")
    with pytest.raises(ValueError, match="Options.wy_dtype"):
        Options(wy_dtype="float16")
    with pytest.raises(ValueError, match="precision must be one of"):
        Options(serial_precision="fp16")
