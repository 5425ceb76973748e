"""The Mosaic GPU serial state passes (``Options.serial_backend="mosaic"``) in interpret mode.

wgmma has no CPU lowering in jax 0.11.2, so on CPU their dots run as ``jnp.dot`` of the same bf16
operands (``state_mosaic``'s docstring); everything else (TMA tiles, barriers, transposed
layouts, document flags, initial and final states) runs as on the device. Checked against the
Triton passes at the same numerics and, end to end, against the float32 token-by-token
reference with FLA's bars."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_repeats_bitwise, assert_vmap_matches_loop,
                      mosaic_kernels_lowered_for_cuda)
from test_pallas_precision import (assert_within_fla_bars, kernel_runs, packed_documents_runs, rel_rms)

from pallas_kernels import state_bwd_triton, state_fwd_triton, state_mosaic
from pallas_kernels.delta_rule import Options, delta_rule_pallas, resolve
from pallas_kernels.triton_common import Dots

# outputs by their kernel; outputs formed in the pass; both with G from the dO-product kernel
# the state passes against their Triton twins: the chunk gradients as the twins form them
# (test_pallas_grads_mosaic has the default's fused kernel)
MOSAIC = Options(serial_backend="mosaic", output_in_serial=False, dout_in_serial=False,
                 fused_grads=False)
FUSED = Options(serial_backend="mosaic", output_in_serial=True, dout_in_serial=False,
                fused_grads=False)
DSERIAL = Options(serial_backend="mosaic", fused_grads=False)  # the default's passes: also G
TWIN = Options(wy_dtype="bfloat16", serial_precision="bf16",  # the Triton passes, same numerics
               wy_apply_precision="bf16")


def transposed(x):
    return jnp.swapaxes(x, -1, -2)


@pytest.mark.parametrize("K", [64, 128])
def test_state_passes_match_the_triton_passes(rand, K):
    """Both passes on 2 rows x 3 chunks (row 0: a document of 2 chunks, then one of 1; row 1:
    one document of 3), 2 V tiles, initial and final document states: the same bf16 operands,
    float32 sums in another order (XLA's dot of a transposed operand), so a few bf16 roundings
    of the stored tensors flip and carry on: relative RMS <= 1e-3, and at least 99 % of the
    elements of every bf16 result bitwise equal to the Triton pass's."""

    def assert_matches(got, want):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and rel_rms(a, b) <= 1e-3
            if a.dtype == bf16:
                assert np.mean(np.asarray(a, np.float32) == np.asarray(b, np.float32)) >= 0.99

    B, H, nc, V = 2, 2, 3, 128
    Tp, bf16 = nc * 64, jnp.bfloat16
    W, kw = (0.3 * rand.normal(B, H, Tp, K, dtype=bf16) for _ in range(2))
    U, A = (rand.normal(B, H, Tp, V, dtype=bf16) for _ in range(2))
    G = rand.normal(B, H, nc, K, V, dtype=bf16)
    gc = jnp.asarray(rand.rng.uniform(0.5, 1.0, (B, H, nc, K)), jnp.float32)
    init, dfinal = rand.normal(3, H, K, V), rand.normal(3, H, K, V)
    doc, first, last = (jnp.asarray(x, jnp.int32) for x in (
        [[0, 0, 1], [2, 2, 2]], [[1, 0, 1], [1, 0, 0]], [[0, 1, 1], [0, 0, 1]]))
    flags = (doc, first, last)
    serial = dict(chunk=64, block_v=64, dots=Dots("bf16", True), num_warps=4, num_stages=2,
                  state_dtype=bf16)

    states, R, final = state_mosaic.state_fwd(W, U, kw, gc, init, *flags, num_docs=3,
                                              interpret=True)
    assert_matches((transposed(states), R, final),
                   state_fwd_triton.state_pass(W, U, kw, gc, init, *flags, num_docs=3, **serial))

    dU, dstates, dinit = state_mosaic.state_bwd(W, kw, gc, A, transposed(G), dfinal, *flags,
                                                interpret=True)
    assert_matches((dU, transposed(dstates), dinit),
                   state_bwd_triton.state_pass(W, kw, gc, A, G, dfinal, *flags, **serial))


@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
def test_mosaic_backend_within_fla_bars(rand, decay):
    """The op with ``serial_backend="mosaic"``, outputs formed by the output kernel or in the
    pass (T = 150: two chunks and a tail; K = 40 and V = 48 padded to 64; an initial state):
    outputs, final state and every gradient within FLA's bars of the float32 reference and
    within 2e-3 of the Triton passes at the same numerics. With the dO products in the backward
    pass (``dout_in_serial``: scale dO rounded to bf16 where the kernel path rounds G) the
    gradients round differently: within the bars, each no more than 1.2x the error of the
    kernel path, and not equal to it (the option is used)."""
    mosaic, fused, dserial, twin, ref = kernel_runs(rand, decay, 7, MOSAIC, FUSED, DSERIAL, TWIN,
                                                    K=40)
    for run in (mosaic, fused):
        assert_within_fla_bars(run, ref)
        assert rel_rms(run[0], twin[0]) <= 2e-3 and rel_rms(run[1], twin[1]) <= 2e-3
        for name in ref[2]:
            assert rel_rms(run[2][name], twin[2][name]) <= 2e-3, name
    assert_within_fla_bars(dserial, ref)
    for name in ref[2]:
        assert rel_rms(dserial[2][name], ref[2][name]) <= 1.2 * rel_rms(mosaic[2][name],
                                                                        ref[2][name]), name
    assert max(rel_rms(dserial[2][n], mosaic[2][n]) for n in ref[2]) > 1e-4


def test_fused_forward_without_gradients_stores_nothing_else(rand):
    """A forward without gradients (outputs in the pass, no per-chunk states or R written):
    the outputs and final state of the forward that stores them for a backward."""
    x = rand.delta_inputs(2, 150, 2, 64, 64, decay="scalar", dtype=jnp.bfloat16)

    def run(options):
        return jax.jit(lambda x: delta_rule_pallas(
            x["q"], x["k"], x["write_key"], x["v"], x["beta"], x["log_decay"], 0.125, None,
            None, 64, options))(x)

    fused, kernel = run(FUSED), run(MOSAIC)
    assert rel_rms(fused[0], kernel[0]) <= 2e-3 and rel_rms(fused[1], kernel[1]) <= 1e-6


@pytest.mark.parametrize("options", [MOSAIC, FUSED], ids=["output_kernel", "fused"])
def test_mosaic_backend_packed_documents(rand, options):
    """Three packed documents (lengths 64, 1, 85: a one-token document, a chunk-unaligned
    boundary, and so one chunk of layout padding after the last document, which the backward
    meets before any document's end) with per-document initial states and a scalar decay:
    within FLA's bars of the float32 reference for outputs, final states and every gradient
    (interpret mode starts every buffer as NaN: nothing unwritten or uninitialised is read)."""
    assert_within_fla_bars(*packed_documents_runs(rand, options))


def test_mosaic_backend_refuses_what_it_cannot_run(rand):
    """float32 inputs, another chunk, head dims, or options that contradict bf16 passes: a
    ValueError naming the cause; the resolved options carry the bf16 settings."""
    r = resolve(MOSAIC, sixteen_bit=True)
    assert (r.wy_dtype, r.state_dtype, r.serial_precision, r.wy_apply_precision) == (
        "bfloat16", "bfloat16", "bf16", "bf16")
    assert resolve(dataclasses.replace(MOSAIC, wy_apply_precision="tf32"),
                   sixteen_bit=True).wy_apply_precision == "tf32"
    assert resolve(Options(), sixteen_bit=True).wy_apply_precision is None  # the Triton passes
    with pytest.raises(ValueError, match="takes 16-bit"):
        resolve(MOSAIC, sixteen_bit=False)
    with pytest.raises(ValueError, match=r"\['state_dtype', 'split'\]|values given for"):
        Options(serial_backend="mosaic", split=False, state_dtype="float32")
    with pytest.raises(ValueError, match="Options.serial_backend must be"):
        Options(serial_backend="cuda")
    x = rand.delta_inputs(1, 64, 1, 32, 64, dtype=jnp.bfloat16)
    args = (x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 1.0, None, None)
    with pytest.raises(ValueError, match="key head dim K in"):
        delta_rule_pallas(*args, 64, MOSAIC)
    x = rand.delta_inputs(1, 64, 1, 64, 64, dtype=jnp.bfloat16)
    args = (x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 1.0, None, None)
    with pytest.raises(ValueError, match="chunk_size 64"):
        delta_rule_pallas(*args, 32, MOSAIC)


def test_the_default_takes_the_mosaic_passes_where_they_run():
    """``serial_backend=None`` resolves to "mosaic" (with the outputs in the forward pass and the
    dO products in the backward one) for 16-bit inputs on a GPU where the shapes fit and no
    option asks for something they cannot do, else to "triton" (with the output and dO-product
    kernels); an explicit choice stays."""
    def picked(options, **kw):
        r = resolve(options, **({"sixteen_bit": True, "mosaic_fits": True} | kw))
        return r.serial_backend, r.output_in_serial, r.dout_in_serial

    assert picked(Options()) == ("mosaic", True, True)
    assert picked(Options(), mosaic_fits=False) == ("triton", False, False)  # CPU, or shapes
    assert picked(Options(), sixteen_bit=False) == ("triton", False, False)
    assert picked(Options(precision="tf32")) == ("triton", False, False)
    assert picked(Options(state_dtype="float32")) == ("triton", False, False)
    assert picked(Options(serial_backend="triton")) == ("triton", False, False)
    assert picked(Options(output_in_serial=False)) == ("mosaic", False, True)
    assert picked(Options(dout_in_serial=False)) == ("mosaic", True, False)
    assert picked(Options(serial_backend="mosaic"), mosaic_fits=False) == ("mosaic", True, True)
    assert state_mosaic.fits(chunk=64, K=128, V=192) and not state_mosaic.fits(chunk=64, K=32, V=64)


def test_mosaic_passes_under_vmap_and_repeat_bitwise(rand):
    """Gradients of a loss of the op with the Mosaic passes: ``jax.vmap`` over rows as [1, T]
    sequences equals the rows one by one, and a second run (compiled afresh) is bitwise the
    first. Not ``jax.checkpoint``: in interpret mode the kernels run I/O callbacks, which remat
    refuses ("Effects not supported in AD of checkpoint"); compiled for the GPU they have none."""
    x = rand.delta_inputs(2, 100, 2, 64, 64, decay="scalar", dtype=jnp.bfloat16)
    names = ("q", "k", "write_key", "v", "beta", "log_decay")

    def loss(*args):
        q, k, kw, v, beta, g = args
        o, final = delta_rule_pallas(q, k, kw, v, beta, g, 0.125, None, None, 64, FUSED)
        return jnp.sum(jnp.sin(o.astype(jnp.float32))) + jnp.sum(final ** 2)

    grad = jax.grad(loss, argnums=tuple(range(6)))
    args = [x[n] for n in names]
    assert_vmap_matches_loop(grad, [a.reshape(2, 1, *a.shape[1:]) for a in args])
    assert_repeats_bitwise(lambda: jax.jit(grad)(*args))


def test_compiled_kernels_carry_no_effects():
    """Traced for the GPU (not interpret mode) both passes are effect-free, so ``jax.checkpoint``
    and ``custom_partitioning`` take them there (interpret mode's I/O callbacks are the CPU's
    alone)."""
    B, H, nc, K, V = 1, 2, 2, 64, 128
    Tp, bf16, f32 = nc * 64, jnp.bfloat16, jnp.float32
    S = jax.ShapeDtypeStruct
    flags = [S((B, nc), jnp.int32)] * 3
    fwd = jax.make_jaxpr(lambda W, U, kw, gc, *fl: state_mosaic.state_fwd(
        W, U, kw, gc, None, *fl, num_docs=None, interpret=False))(
        S((B, H, Tp, K), bf16), S((B, H, Tp, V), bf16), S((B, H, Tp, K), bf16),
        S((B, H, nc, K), f32), *flags)
    bwd = jax.make_jaxpr(lambda W, kw, gc, A, G, df, *fl: state_mosaic.state_bwd(
        W, kw, gc, A, G, df, *fl, interpret=False))(
        S((B, H, Tp, K), bf16), S((B, H, Tp, K), bf16), S((B, H, nc, K), f32),
        S((B, H, Tp, V), bf16), S((B, H, nc, V, K), bf16), S((B, H, K, V), f32), *flags)
    assert not fwd.effects and not bwd.effects


def test_passes_lower_for_cuda():
    """Both passes (the forward forming the outputs, the backward forming G) go through Mosaic
    GPU's lowering for CUDA on the CPU, which runs its layout inference (interpret mode does
    not)."""
    B, H, nc, K, V = 1, 2, 2, 128, 128
    Tp, bf16, f32 = nc * 64, jnp.bfloat16, jnp.float32
    S = jax.ShapeDtypeStruct
    flags = [S((B, nc), jnp.int32)] * 3
    rows = lambda n: S((B, H, Tp, n), bf16)  # noqa: E731
    fwd = lambda W, U, kw, gc, q, P, *fl: state_mosaic.state_fwd(  # noqa: E731
        W, U, kw, gc, None, *fl, num_docs=None, interpret=False, output=(q, P, 0.1, bf16))
    bwd = lambda W, kw, gc, A, df, q, do, *fl: state_mosaic.state_bwd(  # noqa: E731
        W, kw, gc, A, None, df, *fl, interpret=False, products=(q, do, 0.1))
    assert mosaic_kernels_lowered_for_cuda(fwd, [rows(K), rows(V), rows(K), S((B, H, nc, K), f32),
                                                 rows(K), rows(64), *flags]) == 1
    assert mosaic_kernels_lowered_for_cuda(bwd, [rows(K), rows(K), S((B, H, nc, K), f32), rows(V),
                                                 S((B, H, K, V), f32), rows(K),
                                                 S((B, Tp, H, V), bf16), *flags]) == 1
