"""The split delta-core kernels (state_fwd_triton / state_bwd_triton) against the fused ones
(delta_fwd / delta_bwd), on the WY tensors of ``delta_rule.prepare`` (interpret mode on CPU)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from test_pallas_delta import DECAYS, make_inputs

from pallas_kernels.delta_bwd_triton import delta_bwd
from pallas_kernels.delta_rule import Options, _Config, _forward, prepare, resolve
from pallas_kernels.state_bwd_triton import split_backward
from pallas_kernels.state_fwd_triton import split_forward
from pallas_kernels.triton_common import Dots
from precond_linattn.varlen import chunk_layout, to_chunks

C, BV, SCALE, TOL = 16, 16, 0.7, 1e-5
DOTS = Dots("tf32x3", interpret=True)
KERNEL = dict(chunk=C, scale=SCALE, block_v=BV, dots=DOTS, num_warps=4, num_stages=1)


def kernel_inputs(x, decay, cu_seqlens, with_init):
    """make_inputs' tensors in the kernels' layout, as ``delta_rule_pallas`` builds it (head dims
    are powers of two here, so nothing is padded): (config, q, k, k̃, v, β, g, initial, doc,
    first, last)."""
    B, T = x["k"].shape[:2]
    layout = chunk_layout(B, T, C, cu_seqlens)
    nc = layout.doc.shape[1]

    def flat(y):
        return to_chunks(y, layout).reshape(B, nc * C, *y.shape[2:])

    last = jnp.zeros(layout.doc.shape, jnp.int32).at[layout.final_row, layout.final_chunk].set(1)
    cfg = _Config(C, decay, SCALE, None if cu_seqlens is None else layout.num_docs,
                  resolve(Options(block_v=BV), sixteen_bit=False), DOTS, DOTS)
    init = x["initial_state"] if with_init else None
    g = None if decay == "none" else flat(x["log_decay"])
    return (cfg, *(flat(x[n]) for n in ("q", "k", "write_key", "v", "beta")), g, init,
            layout.doc.astype(jnp.int32), layout.first.astype(jnp.int32), last)


def check_split(seed, decay, cu_seqlens=None, with_init=True, **shape):
    """Split forward == delta_fwd (o, final, chunk states); split backward == delta_bwd (partial
    sums over V tiles added up) on random dO and dfinal."""
    x = make_inputs(seed, decay, **shape)
    cfg, q, k, kw, v, beta, g, init, doc, first, last = kernel_inputs(
        x, decay, cu_seqlens, with_init)
    wy = prepare(cfg, q, k, kw, v, beta, g)
    want = _forward(cfg, q, k, kw, v, beta, g, init, doc, first, last, True)
    got = split_forward(*wy, init, doc, first, last, num_docs=cfg.num_docs, store_states=True,
                        out_dtype=v.dtype, **KERNEL)
    assert len(got) == 4  # o, final, states and R for the backward
    for name, a, b in zip(("o", "final", "states"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, TOL, name)

    rng = np.random.default_rng(seed + 100)
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    dfinal = jnp.asarray(rng.standard_normal(want[1].shape), jnp.float32)
    args = (*wy, want[2], do, dfinal, doc, first, last)
    R = got[3]  # R = U − W S per chunk
    W_chunks = wy[0].reshape(*R.shape[:2], -1, C, wy[0].shape[-1])
    WS = jnp.einsum("bhnck,bhnkv->bhncv", W_chunks, want[2], precision="highest")
    assert_close(R, wy[1] - WS.reshape(R.shape), TOL, "R")
    got = split_backward(*wy, want[2], R, do, dfinal, doc, first, last, block_k=16, **KERNEL)
    want = delta_bwd(*args, **KERNEL)
    for name, a, b in zip(("dW", "dU", "dK̃'", "dQ'", "dP", "dΓ_C", "dS_0"), got, want):
        if name not in ("dU", "dS_0"):
            assert a.shape[0] == 1, name
            a, b = a.sum(0), b.sum(0)
        assert a.shape == b.shape, name
        assert_close(a, b, TOL, name)


@pytest.mark.parametrize("decay", DECAYS)
def test_dense_with_initial_state(decay):
    """Odd T (37, chunk 16), two heads, two V tiles, one initial state per row."""
    check_split(0, decay)


def test_dense_without_initial_state_k_above_v():
    """K = 32 > V = 16: two key tiles of 16 rows in the per-chunk cotangent kernel."""
    check_split(1, "scalar", with_init=False, k_dim=32, v_dim=16)


@pytest.mark.parametrize("decay", DECAYS)
def test_packed_documents(decay):
    """cu_seqlens: states restart at each document (one initial state each); unused tail chunks."""
    cu = jnp.asarray([0, 5, 22, 37], jnp.int32)
    check_split(2, decay, cu, b=1, n_init=3)


def test_serial_block_v():
    """``serial_block_v`` (the state passes' V tile) narrower than ``block_v``: the split forward
    and backward equal the defaults (64 value columns: serial tiles of 16, parallel tiles of 32)."""
    x = make_inputs(3, "scalar", v_dim=64)
    cfg, q, k, kw, v, beta, g, init, doc, first, last = kernel_inputs(x, "scalar", None, True)
    wy = prepare(cfg, q, k, kw, v, beta, g)
    kernel = KERNEL | dict(block_v=32)
    want = split_forward(*wy, init, doc, first, last, num_docs=None, store_states=True, **kernel)
    got = split_forward(*wy, init, doc, first, last, num_docs=None, store_states=True,
                        serial_block_v=16, **kernel)
    for name, a, b in zip(("o", "final", "states", "R"), got, want):
        assert_close(a, b, TOL, name)
    rng = np.random.default_rng(4)
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    dfinal = jnp.asarray(rng.standard_normal(want[1].shape), jnp.float32)
    args = (*wy, want[2], want[3], do, dfinal, doc, first, last)
    for name, a, b in zip(("dW", "dU", "dK̃'", "dQ'", "dP", "dΓ_C", "dS_0"),
                          split_backward(*args, serial_block_v=16, **kernel),
                          split_backward(*args, **kernel)):
        assert_close(a, b, TOL, name)


@pytest.mark.parametrize("decay", ["none", "scalar"])
def test_outputs_and_dout_products_in_the_serial_passes(decay):
    """``output_in_serial`` (o formed in the forward state pass; without ``store_states`` the
    states and R are not written) and ``dout_in_serial`` (A, G formed in the backward pass)
    equal the separate kernels; packed documents, an initial state per document."""
    cu = jnp.asarray([0, 5, 22, 37], jnp.int32)
    x = make_inputs(5, decay, b=1, n_init=3)
    cfg, q, k, kw, v, beta, g, init, doc, first, last = kernel_inputs(x, decay, cu, True)
    wy = prepare(cfg, q, k, kw, v, beta, g)
    fwd = lambda **o: split_forward(*wy, init, doc, first, last,  # noqa: E731
                                    num_docs=cfg.num_docs, **KERNEL, **o)
    want = fwd(store_states=True)
    got = fwd(store_states=True, output_in_serial=True)
    for name, a, b in zip(("o", "final", "states", "R"), got, want):
        assert a.shape == b.shape, name
        assert_close(a, b, TOL, name)
    inference = fwd(store_states=False, output_in_serial=True)
    assert len(inference) == 2
    assert_close(inference[0], want[0], TOL, "o (no states stored)")
    rng = np.random.default_rng(6)
    do = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
    dfinal = jnp.asarray(rng.standard_normal(want[1].shape), jnp.float32)
    args = (*wy, want[2], want[3], do, dfinal, doc, first, last)
    for name, a, b in zip(("dW", "dU", "dK̃'", "dQ'", "dP", "dΓ_C", "dS_0"),
                          split_backward(*args, dout_in_serial=True, **KERNEL),
                          split_backward(*args, **KERNEL)):
        assert_close(a, b, TOL, name)


def test_bad_inputs_raise():
    """Dimensions the Triton lowering cannot take, or a P of the wrong chunk, are refused before
    any kernel is built."""
    W, U, P = jnp.zeros((1, 1, 32, 24)), jnp.zeros((1, 1, 32, 32)), jnp.zeros((1, 1, 32, C))
    gc, flags, states = jnp.ones((1, 1, 2, 24)), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1, 2, 24, 32))
    with pytest.raises(ValueError, match="head dim K"):
        split_forward(W, U, W, W, P, gc, None, flags, flags, flags, num_docs=None,
                      store_states=False, **KERNEL)
    with pytest.raises(ValueError, match="block_v"):
        split_backward(U, U, U, U, P, gc, states, U, U, states[0], flags, flags, flags,
                       **{**KERNEL, "block_v": 24})
    with pytest.raises(ValueError, match="serial_block_v"):
        split_backward(U, U, U, U, P, gc, states, U, U, states[0], flags, flags, flags,
                       serial_block_v=24, **KERNEL)
    with pytest.raises(ValueError, match="P must be"):
        split_backward(U, U, U, U, U, gc, states, U, U, states[0], flags, flags, flags, **KERNEL)
