"""The serial state passes over a sequence cut into pieces (``sequence_split``): the algorithm
exactly (float32 Triton passes in interpret mode: the same states, R, outputs, cotangents as the
unsplit pass up to float32 rounding), the Mosaic passes through it within bf16 rounding, the op
with ``Options.sequence_pieces`` within FLA's bars, and the automatic choice."""

import functools

import jax
import jax.numpy as jnp
import pytest
from test_pallas_precision import assert_within_fla_bars, outputs_and_grads, rel_rms

import precond_linattn as pla
from pallas_kernels import sequence_split, state_bwd_triton, state_fwd_triton, state_mosaic
from pallas_kernels.delta_rule import Options, delta_rule_pallas
from pallas_kernels.triton_common import Dots

B, H, NC, K, V, P = 2, 2, 8, 64, 64, 4


def dense_rows(rand, dtype):
    """A dense batch's pass inputs: W, K̃' [B, H, Tp, K], U, A [B, H, Tp, V], Γ_C, flags (row b
    is document b), initial and final-state cotangents, Q', P, dO."""
    Tp = NC * 64
    W, kw = (0.05 * rand.normal(B, H, Tp, K, dtype=dtype) for _ in range(2))  # states stay O(1)
    q = 0.2 * rand.normal(B, H, Tp, K, dtype=dtype)
    U, A = (rand.normal(B, H, Tp, V, dtype=dtype) for _ in range(2))
    gc = jnp.asarray(rand.rng.uniform(0.7, 1.0, (B, H, NC, K)), jnp.float32)
    Pm = 0.1 * rand.normal(B, H, Tp, 64, dtype=dtype)
    do = rand.normal(B, Tp, H, V, dtype=dtype)
    doc = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, NC))
    first = jnp.zeros((B, NC), jnp.int32).at[:, 0].set(1)
    last = jnp.zeros((B, NC), jnp.int32).at[:, -1].set(1)
    init, dfinal = rand.normal(B, H, K, V), rand.normal(B, H, K, V)
    return dict(W=W, kw=kw, q=q, U=U, A=A, gc=gc, P=Pm, do=do, flags=(doc, first, last),
                init=init, dfinal=dfinal)


def assert_close(got, want, tol):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_rms(a, b) <= tol, rel_rms(a, b)


def test_split_passes_equal_the_serial_passes_in_float32(rand):
    """float32 Triton passes (ieee dots): 4 pieces of 2 chunks, an initial state, outputs formed
    in the pass; backward with G: every result equal to the unsplit pass's up to float32
    rounding (the chain reassociates the products)."""
    x = dense_rows(rand, jnp.float32)
    dots = Dots("ieee", True)
    serial = dict(chunk=64, num_docs=None, block_v=32, dots=dots, num_warps=4, num_stages=1)
    fwd = functools.partial(state_fwd_triton.state_pass, **serial)
    args = (x["W"], x["U"], x["kw"], x["gc"], x["init"], *x["flags"])
    output = (x["q"], x["P"], 0.5, dots, jnp.float32)
    assert_close(sequence_split.forward(fwd, P)(*args, output=output), fwd(*args, output=output),
                 1e-5)
    G = rand.normal(B, H, NC, K, V)
    serial.pop("num_docs")
    bwd = functools.partial(state_bwd_triton.state_pass, **serial)
    args = (x["W"], x["kw"], x["gc"], x["A"], G, x["dfinal"], *x["flags"])
    assert_close(sequence_split.backward(bwd, P, transposed=False)(*args), bwd(*args), 1e-5)


def f32(xs):
    return [x.astype(jnp.float32) if x is not None and x.dtype == jnp.bfloat16 else x for x in xs]


@pytest.mark.parametrize("products", [False, True])
def test_split_mosaic_passes_within_bf16_rounding(rand, products):
    """The Mosaic passes (interpret mode) through the split, the backward with G or forming its
    dO products: against the float32 pass on the same values every result is as close as the
    unsplit Mosaic pass's (at most 1.25x its relative RMS error; shorter bf16 chains make the
    split's usually smaller)."""
    x = dense_rows(rand, jnp.bfloat16)
    exact = dict(chunk=64, block_v=64, dots=Dots("ieee", True), num_warps=4, num_stages=1)

    def assert_as_close(got, want, truth):
        for a, b, t in zip(got, want, truth, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel_rms(a, t) <= 1.25 * rel_rms(b, t), (rel_rms(a, t), rel_rms(b, t))

    T = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731  Mosaic's transposed states
    fwd = functools.partial(state_mosaic.state_fwd, num_docs=None, interpret=True)
    args = (x["W"], x["U"], x["kw"], x["gc"], x["init"], *x["flags"])
    output = (x["q"], x["P"], 0.5, jnp.bfloat16)
    states, R, final, o = state_fwd_triton.state_pass(
        *f32(args), num_docs=None, output=(*f32((x["q"], x["P"])), 0.5, exact["dots"],
                                           jnp.float32), **exact)
    assert_as_close(sequence_split.forward(fwd, P)(*args, output=output),
                    fwd(*args, output=output), (T(states), R, final, o))
    bwd = functools.partial(state_mosaic.state_bwd, interpret=True)
    G = rand.normal(B, H, NC, V, K, dtype=jnp.bfloat16)
    args = (x["W"], x["kw"], x["gc"], x["A"], None if products else G, x["dfinal"], *x["flags"])
    kw = dict(products=(x["q"], x["do"], 0.5)) if products else {}
    if products:  # the float32 pass with G = scale Q'ᵀ dO formed outside
        G = 0.5 * jnp.einsum("bhcsk,bhcsv->bhcvk", *(f32([x["q"]])[0].reshape(B, H, NC, 64, K),
                             f32([x["do"]])[0].transpose(0, 2, 1, 3).reshape(B, H, NC, 64, V)),
                             precision="highest")
    dU, dstates, dinit = state_bwd_triton.state_pass(*f32(args[:4]), T(f32([G])[0]), *args[5:],
                                                     **exact)
    assert_as_close(sequence_split.backward(bwd, P)(*args, **kw), bwd(*args, **kw),
                    (dU, T(dstates), dinit))


@pytest.mark.parametrize("decay", [None, "scalar"])
@pytest.mark.parametrize("fused_grads", [False, True])
def test_op_with_sequence_pieces_within_fla_bars(rand, decay, fused_grads):
    """The op on the Mosaic passes with ``sequence_pieces=4`` (T = 500: 8 chunks, a tail; an
    initial state; K = V = 64), the chunk gradients from ``chunk_grads`` + ``wy_bwd`` or the fused
    kernel (which reads the pieces' chunk states): outputs, final state and every gradient
    within FLA's bars of the float32 token-by-token reference."""
    x = rand.delta_inputs(1, 500, 2, 64, 64, decay=decay, dtype=jnp.bfloat16)
    x = {n: a for n, a in x.items() if a is not None}
    x["s0"] = rand.normal(1, 2, 64, 64)

    def kernel(x):
        return delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"],
                                 x.get("log_decay"), 0.125, x["s0"], None, 64,
                                 Options(serial_backend="mosaic", sequence_pieces=4,
                                         fused_grads=fused_grads))

    def reference(x):
        return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["write_key"],
                              log_decay=x.get("log_decay"), initial_state=x["s0"], scale=0.125,
                              output_final_state=True, impl="reference")

    key = jax.random.key(5)
    got, ref = (jax.jit(functools.partial(outputs_and_grads, f))(x, key)
                for f in (kernel, reference))
    assert_within_fla_bars(got, ref)


def test_pieces_are_chosen_for_idle_gpus_and_checked(rand):
    """auto: as many pieces as keep the CTAs within the SMs and >= 8 chunks a piece; explicit
    pieces need the Mosaic passes, dense rows and a chunk count they divide."""
    assert sequence_split.auto_pieces(programs=16, chunks=512) == 8  # B = 1, H = 8, V = 128
    assert sequence_split.auto_pieces(programs=16, chunks=32) == 4  # a 2048-token prefill
    assert sequence_split.auto_pieces(programs=128, chunks=32) == 1  # B = 8: the GPU is full
    assert sequence_split.auto_pieces(programs=16, chunks=12) == 1
    x = rand.delta_inputs(1, 128, 1, 64, 64, dtype=jnp.bfloat16)
    args = (x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 1.0, None)
    with pytest.raises(ValueError, match="sequence_pieces=4 needs"):
        delta_rule_pallas(*args, None, 64, Options(serial_backend="mosaic", sequence_pieces=4))
    with pytest.raises(ValueError, match="sequence_pieces=2 needs"):
        delta_rule_pallas(*args, jnp.asarray([0, 64, 128]), 64,
                          Options(serial_backend="mosaic", sequence_pieces=2))
    with pytest.raises(ValueError, match="power of two"):
        Options(sequence_pieces=3)
