"""The delta core: chunked WY form == token-by-token reference, forward, final state, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond_linattn as pla
from conftest import packed_cu_seqlens, rel_err

DECAYS = [None, "scalar", "vector"]
B, T, H, K, V, C = 2, 37, 3, 8, 5, 16


def run(impl, inp, **kw):
    return pla.delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], write_key=inp["write_key"],
                          log_decay=inp["log_decay"], impl=impl, chunk_size=C,
                          output_final_state=True, **kw)


@pytest.mark.parametrize("decay", DECAYS)
def test_chunked_matches_reference_fp32(rand, decay):
    inp = rand.delta_inputs(B, T, H, K, V, decay)
    h0 = rand.normal(B, H, K, V)
    o_ref, s_ref = run("reference", inp, initial_state=h0)
    o, s = run("chunked", inp, initial_state=h0)
    assert o.dtype == jnp.float32 and s.shape == (B, H, K, V)
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("decay", DECAYS)
def test_chunked_matches_reference_bf16(rand, decay):
    inp = rand.delta_inputs(B, T, H, K, V, decay, dtype=jnp.bfloat16)
    o_ref, s_ref = run("reference", inp)
    o, s = run("chunked", inp)
    assert o.dtype == jnp.bfloat16
    assert rel_err(o, o_ref) <= 1e-2  # bf16 output rounding; the math is fp32 on both sides
    assert rel_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("T_, C_", [(5, 64), (64, 64), (65, 64), (48, 32)])
def test_tail_and_chunk_sizes(rand, T_, C_):
    inp = rand.delta_inputs(1, T_, 2, K, V, "vector")
    args = (inp["q"], inp["k"], inp["v"], inp["beta"])
    kw = dict(write_key=inp["write_key"], log_decay=inp["log_decay"], output_final_state=True)
    o_ref, s_ref = pla.delta_rule(*args, impl="reference", **kw)
    o, s = pla.delta_rule(*args, impl="chunked", chunk_size=C_, **kw)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("decay", DECAYS)
def test_gradients_match_reference(rand, decay):
    inp = rand.delta_inputs(B, 21, 2, K, V, decay)
    inp["initial_state"] = rand.normal(B, 2, K, V)
    names = [n for n, x in inp.items() if x is not None]
    do, ds = rand.normal(B, 21, 2, V), rand.normal(B, 2, K, V)

    def loss(impl, xs):
        o, s = pla.delta_rule(xs["q"], xs["k"], xs["v"], xs["beta"], write_key=xs["write_key"],
                              log_decay=xs.get("log_decay"), initial_state=xs["initial_state"],
                              impl=impl, chunk_size=8, output_final_state=True)
        return jnp.sum(o * do) + jnp.sum(s * ds)

    xs = {n: inp[n] for n in names}
    g_ref = jax.grad(lambda x: loss("reference", x))(xs)
    g = jax.jit(jax.grad(lambda x: loss("chunked", x)))(xs)
    for n in names:
        assert rel_err(g[n], g_ref[n]) <= 1e-5, n


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("decay", [None, "vector"])
def test_packed_equals_documents_one_by_one(rand, impl, decay):
    lengths = [5, 17, 1, 20]
    Tp = sum(lengths)
    inp = rand.delta_inputs(1, Tp, H, K, V, decay)
    h0 = rand.normal(len(lengths), H, K, V)
    o, s = run(impl, inp, initial_state=h0, cu_seqlens=packed_cu_seqlens(lengths))
    start = 0
    for n, length in enumerate(lengths):
        doc = {k: (None if x is None else x[:, start:start + length]) for k, x in inp.items()}
        o_n, s_n = run("reference", doc, initial_state=h0[n:n + 1])
        assert rel_err(o[:, start:start + length], o_n) <= 1e-5
        assert rel_err(s[n:n + 1], s_n) <= 1e-5
        start += length


def test_packed_under_jit_with_traced_offsets(rand):
    lengths = [9, 30, 4]
    inp = rand.delta_inputs(1, sum(lengths), H, K, V, "scalar")
    cu = packed_cu_seqlens(lengths)
    f = jax.jit(lambda cu: run("chunked", inp, cu_seqlens=cu))
    o, s = f(cu)
    o_ref, s_ref = run("reference", inp, cu_seqlens=cu)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


def test_default_write_key_is_read_key(rand):
    inp = rand.delta_inputs(B, T, H, K, V, "scalar")
    args = (inp["q"], inp["k"], inp["v"], inp["beta"])
    o1, _ = pla.delta_rule(*args, log_decay=inp["log_decay"], impl="chunked")
    o2, _ = pla.delta_rule(*args, write_key=inp["k"], log_decay=inp["log_decay"], impl="chunked")
    np.testing.assert_array_equal(o1, o2)
    assert pla.delta_rule(*args, impl="chunked")[1] is None


@pytest.mark.parametrize("decay", DECAYS)
def test_step_matches_reference(rand, decay):
    inp = rand.delta_inputs(B, 9, H, K, V, decay)
    h0 = rand.normal(B, H, K, V)
    o_ref, s_ref = run("reference", inp, initial_state=h0, scale=0.7)
    S, outs = h0, []
    for t in range(9):
        g = None if inp["log_decay"] is None else inp["log_decay"][:, t]
        o, S = pla.delta_rule_step(inp["q"][:, t], inp["k"][:, t], inp["v"][:, t], inp["beta"][:, t],
                                   S, write_key=inp["write_key"][:, t], log_decay=g, scale=0.7)
        outs.append(o)
    assert rel_err(jnp.stack(outs, 1), o_ref) <= 1e-6 and rel_err(S, s_ref) <= 1e-6


def test_long_vector_decay_does_not_overflow(rand):
    inp = rand.delta_inputs(1, 128, 1, K, V, None)
    inp["log_decay"] = jnp.asarray(-rand.rng.uniform(3.0, 8.0, (1, 128, 1, K)), jnp.float32)
    o_ref, _ = run("reference", inp)
    o, _ = pla.delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], write_key=inp["write_key"],
                          log_decay=inp["log_decay"], impl="chunked", chunk_size=64)
    assert np.isfinite(np.asarray(o)).all() and rel_err(o, o_ref) <= 1e-5


def test_chunk_layout_maps_are_gathers_with_exact_transposes(rand):
    """to_chunks / from_chunks of packed documents (one token after the last document): round
    trip, each map's VJP is the other map (fill 0), and no pass holds a scatter (on a GPU, XLA's
    transpose of a gather, a scatter-add, costs atomics)."""
    from precond_linattn.varlen import chunk_layout, from_chunks, to_chunks
    cu = jnp.asarray([0, 5, 22, 36], jnp.int32)  # T = 37: token 36 belongs to no document
    layout = chunk_layout(1, 37, 8, cu)
    x = rand.normal(1, 37, 2, 3)
    y, to_vjp = jax.vjp(lambda x: to_chunks(x, layout, fill=7.0), x)
    assert jnp.all(jnp.where(layout.index[..., None, None] == 37, y == 7.0, True))
    x_back = from_chunks(y, layout)
    assert jnp.array_equal(x_back[:, :36], x[:, :36]) and jnp.all(x_back[:, 36] == 0)
    dy = rand.normal(*y.shape)
    np.testing.assert_array_equal(to_vjp(dy)[0], from_chunks(dy, layout))
    _, from_vjp = jax.vjp(lambda y: from_chunks(y, layout), y)
    np.testing.assert_array_equal(from_vjp(x)[0], to_chunks(x, layout))
    for f, arg in ((to_vjp, dy), (from_vjp, x)):
        assert "scatter" not in jax.jit(f).lower(arg).as_text()


def test_chunk_layout_is_as_short_as_the_documents_allow():
    """NC is the bound floor((T + N (C - 1)) / C) on the chunks N documents need: one document
    of 4 full chunks takes 4 (no spare chunk), five 1-token documents and a 3-chunk one fill the
    bound exactly, and every document's tokens are in its slots."""
    from precond_linattn.varlen import chunk_layout
    assert chunk_layout(1, 64, 16, jnp.asarray([0, 64], jnp.int32)).doc.shape[1] == 4
    cu = jnp.asarray([0, 1, 2, 3, 4, 5, 53], jnp.int32)  # T = 53: 5 + ceil(48 / 16) = 8 chunks
    layout = chunk_layout(1, 53, 16, cu)
    assert layout.doc.shape[1] == (53 + 6 * 15) // 16 == 8
    assert sorted(np.asarray(layout.index).ravel().tolist())[:53] == list(range(53))
