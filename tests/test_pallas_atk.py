"""atk_precondition(impl="pallas") against the token-by-token reference (interpret mode on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond_linattn as pla
from pallas_kernels import REGISTRY
from pallas_kernels.atk_precond import Options, atk_pallas
from conftest import (assert_repeats_bitwise, assert_runs_match, assert_vmap_matches_loop,
                      fixed_loss_run, triton_kernels_lowered_for_cuda)

B, T, H, K = 2, 37, 3, 24
NAMES = ("k", "log_decay", "gain", "center", "initial_state")


def make_inputs(seed, *, b=B, t=T, h=H, k_dim=K, n_init=B, decay="head", dtype=jnp.float32):
    """Keys, decay g in (−1, 0) (some tokens near −8: α tiny), gain in (0.05, 0.95), centres around
    the log of the typical A, initial A in (0, 3)."""
    rng = np.random.default_rng(seed)
    shape = (b, t, h) if decay == "head" else (b, t, h, k_dim)
    g = -rng.uniform(0.0, 1.0, shape) * np.where(rng.uniform(size=shape) < 0.1, 8.0, 1.0)
    return dict(k=jnp.asarray(rng.standard_normal((b, t, h, k_dim)), dtype),
                log_decay=jnp.asarray(g, dtype),
                gain=jnp.asarray(rng.uniform(0.05, 0.95, (b, t, h)), dtype),
                center=jnp.asarray(rng.uniform(-1.0, 1.0, (h,)), dtype),
                initial_state=jnp.asarray(rng.uniform(0.0, 3.0, (n_init, h, k_dim)), jnp.float32))


def run(impl, inputs, *, x=1.5, cu_seqlens=None, initial=True, decay=True, options=None):
    """k̃, final A and the gradients of conftest's fixed loss w.r.t. every input."""

    def f(inp):
        kwargs = dict(x=x, initial_state=inp["initial_state"] if initial else None,
                      output_final_state=True, cu_seqlens=cu_seqlens)
        g = inp["log_decay"] if decay else None
        if options is None:
            return pla.atk_precondition(inp["k"], g, inp["gain"], inp["center"], impl=impl,
                                        **kwargs)
        g = jnp.zeros(inp["gain"].shape) if g is None else g  # the kernel, non-default tuning
        return atk_pallas(inp["k"], g, inp["gain"], inp["center"], x, 1e-6,
                          kwargs["initial_state"], cu_seqlens, 64, options)

    return fixed_loss_run(f, inputs)


def test_registered_and_dispatched(monkeypatch):
    """REGISTRY["atk_precondition"] is this kernel and impl="pallas" calls it."""
    supports, kernel = REGISTRY["atk_precondition"]
    assert kernel is atk_pallas
    assert supports(K=128, dtype=jnp.bfloat16, decay=4) and supports(K=100, dtype=jnp.float32)
    assert not supports(K=256, dtype=jnp.float32)
    calls = []

    def spy(*args):
        calls.append(len(args))
        return kernel(*args)

    monkeypatch.setitem(REGISTRY, "atk_precondition", (supports, spy))
    x = make_inputs(0, t=5)
    pla.atk_precondition(x["k"], x["log_decay"], x["gain"], x["center"], impl="pallas")
    assert calls == [9]


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("x", [1.5, 1.0])
def test_matches_reference(decay, x):
    """Forward, final state and gradients of every input; odd T (not a multiple of the token
    block), K = 24 padded to 32, three heads; x = 1 gives k̃ = k."""
    inp = make_inputs(1, decay=decay)
    got = run("pallas", inp, x=x)
    assert_runs_match(got, run("reference", inp, x=x), 1e-5)
    if x == 1.0:
        np.testing.assert_array_equal(got[0], inp["k"].astype(jnp.float32))


def test_no_decay_default_initial_state():
    inp = make_inputs(2)
    names = ("k", "gain", "center")
    assert_runs_match(run("pallas", inp, initial=False, decay=False),
                      run("reference", inp, initial=False, decay=False), 1e-5, names)


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("initial", [True, False])
def test_packed_documents(decay, initial):
    """cu_seqlens: A restarts at each document (from its own initial state, or zeros); documents
    (one of a single token) start and end inside the 16-token blocks."""
    cu = jnp.asarray([0, 5, 22, 23, 37], jnp.int32)
    inp = make_inputs(3, b=1, n_init=4, decay=decay)
    names = NAMES if initial else NAMES[:-1]
    assert_runs_match(run("pallas", inp, cu_seqlens=cu, initial=initial),
                      run("reference", inp, cu_seqlens=cu, initial=initial), 1e-5, names)


@pytest.mark.parametrize("options", [Options(block_t=1, block_k=16, prefetch=3),
                                     Options(block_t=8, block_k=128, prefetch=1)])
def test_tuning_options(options):
    """Non-default tuning: one token per block with K split over two programs per head (per-head
    sums added outside), or blocks of 8 tokens with one program per head; dense and packed."""
    inp = make_inputs(4, decay="head")
    cu = jnp.asarray([0, 9, 37], jnp.int32)
    inp1 = make_inputs(4, b=1, n_init=2, decay="channel")
    assert_runs_match(run("pallas", inp, options=options), run("reference", inp), 1e-5)
    assert_runs_match(run("pallas", inp1, cu_seqlens=cu, options=options),
                      run("reference", inp1, cu_seqlens=cu), 1e-5)


@pytest.mark.parametrize("decay", ["head", "channel"])
def test_bf16_inputs(decay):
    """bf16 inputs: float32 inside, so the reference's answer on the same bf16 values up to one
    bf16 rounding of k̃ and of each gradient (the final state is float32)."""
    inp = make_inputs(5, decay=decay, dtype=jnp.bfloat16)
    got, want = run("pallas", inp), run("reference", inp)
    assert got[2]["k"].dtype == jnp.bfloat16
    assert_runs_match(got, want, 4e-3)


@pytest.mark.heavy
def test_vmap():
    inp = make_inputs(6, decay="channel")

    def grads(*args):
        def loss(k, g, gain, c, A0):
            kw, final = pla.atk_precondition(k, g, gain, c, initial_state=A0,
                                             output_final_state=True, impl="pallas")
            return jnp.sum(jnp.sin(kw)) + jnp.sum(final ** 2)
        return jax.grad(loss, argnums=range(5))(*args)

    split = [inp[n].reshape(B, 1, *inp[n].shape[1:]) if n != "center"
             else jnp.stack([inp[n], -inp[n]]) for n in NAMES]  # a centre per vmapped call
    assert_vmap_matches_loop(grads, split)


def test_second_run_bitwise_identical():
    inp = make_inputs(7, decay="channel")
    assert_repeats_bitwise(lambda: run("pallas", inp))


def test_unsupported_calls_raise():
    x = make_inputs(8, t=4, k_dim=256)
    with pytest.raises(ValueError, match="K <= 128"):
        pla.atk_precondition(x["k"], None, x["gain"], x["center"], impl="pallas")
    y = make_inputs(8, t=4)
    with pytest.raises(ValueError, match="traced"):
        jax.jit(lambda s: pla.atk_precondition(y["k"], None, y["gain"], y["center"], x=s,
                                               impl="pallas"))(1.5)
    with pytest.raises(ValueError, match="options"):
        atk_pallas(y["k"], y["log_decay"], y["gain"], y["center"], 1.5, 1e-6, None, None, 64,
                   Options(block_k=24))


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("pieces, initial", [(2, True), (4, False)])
def test_sequence_pieces(monkeypatch, decay, pieces, initial):
    """Dense rows cut into pieces (T = 37 padded to whole 4-token blocks in every piece): the
    pass from zero, the chain of piece states (forward, and backward from the last piece down)
    and the full pass give the reference's k̃, final state and gradients. The chain was traced
    once backwards and twice forwards (in the op's own jaxpr, which ``partition.lowered_once``'s
    jit traces, and in its VJP's forward); packed documents are never split."""
    from pallas_kernels import atk_precond
    chains = []
    real = atk_precond._chain
    monkeypatch.setattr(atk_precond, "_chain",
                        lambda *a, **kw: chains.append(kw.get("reverse", False)) or real(*a, **kw))
    options = Options(block_t=4, sequence_pieces=pieces)
    inp = make_inputs(9, decay=decay)
    names = NAMES if initial else NAMES[:-1]
    assert_runs_match(run("pallas", inp, initial=initial, options=options),
                      run("reference", inp, initial=initial), 1e-5, names)
    assert sorted(chains) == [False, False, True]
    cu = jnp.asarray([0, 9, 37], jnp.int32)
    inp1 = make_inputs(9, b=1, n_init=2, decay=decay)
    assert_runs_match(run("pallas", inp1, cu_seqlens=cu, options=options),
                      run("reference", inp1, cu_seqlens=cu), 1e-5)
    assert len(chains) == 3


def test_auto_pieces_and_bad_pieces():
    """auto_pieces: a power of two, programs x pieces within TARGET_PROGRAMS, pieces of at least
    MIN_PIECE tokens; a bad count is a ValueError naming it."""
    from pallas_kernels.token_pieces import MIN_PIECE, TARGET_PROGRAMS, auto_pieces
    for programs, T in [(256, 2048), (32, 2048), (8, 32768), (2048, 2048), (32, 100)]:
        p = auto_pieces(programs=programs, T=T)
        assert p & (p - 1) == 0 and (p == 1 or (programs * p <= TARGET_PROGRAMS
                                                and T // p >= MIN_PIECE))
        assert 2 * programs * p > TARGET_PROGRAMS or T // (2 * p) < MIN_PIECE
    assert auto_pieces(programs=32, T=2048) == 16 and auto_pieces(programs=2048, T=2048) == 1
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="sequence_pieces"):
            Options(sequence_pieces=bad)


@pytest.mark.parametrize("decay", ["head", "channel"])
def test_sequence_pieces_lower_for_cuda(decay):
    """The split's four kernels (the recurrence alone and the full pass, each way) go through the
    Triton lowering for CUDA (no GPU needed: an abstract H100 mesh); K = 128, bf16, T = 300 (the
    Triton kernels: with a per-head decay the Mosaic ones are the default here)."""
    b, t = 2, 300
    g_shape = (b, t, H) if decay == "head" else (b, t, H, 128)
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((b, t, H, 128), jnp.bfloat16), (g_shape, jnp.float32), ((b, t, H), jnp.bfloat16),
        ((H,), jnp.float32))]

    def loss(k, g, gain, c):
        kw, final = atk_pallas(k, g, gain, c, 1.5, 1e-6, None, None, 64,
                               Options(sequence_pieces=2, mosaic=False), interpret=False)
        return jnp.sum(kw.astype(jnp.float32) ** 2) + jnp.sum(final)

    assert triton_kernels_lowered_for_cuda(loss, args) == 4
