"""delta_rule(impl="pallas") against the token-by-token reference (interpret mode on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond_linattn as pla
from pallas_kernels import REGISTRY
from pallas_kernels.delta_rule import Options, delta_rule_pallas
from precond_linattn.reference.delta import delta_step
from conftest import (assert_close, assert_repeats_bitwise, assert_runs_match,
                      assert_vmap_matches_loop, fixed_loss_run)

B, T, H, K, V, C = 2, 37, 2, 16, 32, 16
DECAYS = ("none", "scalar", "vector")


def make_inputs(seed, decay, b=B, t=T, k_dim=K, v_dim=V, n_init=B, dtype=jnp.float32,
                similar=0.0):
    """Unit read keys and queries, write key k̃ = d ⊙ k with d in [0.5, 2], β in (0, 1), g < 0.
    ``similar`` s > 0: every key of a (row, head) shares a direction, k = unit(z + s c) with z, c
    standard normal (mean cosine s² / (1 + s²) between keys), as in trained models' chunks."""
    rng = np.random.default_rng(seed)

    def unit(*shape, shared=0.0):
        x = rng.standard_normal(shape) + shared
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    k = unit(b, t, H, k_dim, shared=similar * rng.standard_normal((b, 1, H, k_dim)))
    x = dict(q=unit(b, t, H, k_dim), k=k, write_key=k * rng.uniform(0.5, 2.0, k.shape),
             v=rng.standard_normal((b, t, H, v_dim)), beta=rng.uniform(0.05, 0.95, (b, t, H)),
             initial_state=rng.standard_normal((n_init, H, k_dim, v_dim)))
    if decay == "scalar":
        x["log_decay"] = -rng.uniform(0.01, 0.5, (b, t, H))
    elif decay == "vector":
        x["log_decay"] = -rng.uniform(0.01, 0.5, (b, t, H, k_dim))
    return {n: jnp.asarray(a, jnp.float32 if n == "initial_state" else dtype) for n, a in x.items()}


def run(impl, inputs, cu_seqlens=None, chunk=C):
    """Outputs, final states and the gradients of conftest's fixed loss w.r.t. every input."""
    return fixed_loss_run(lambda x: pla.delta_rule(
        x["q"], x["k"], x["v"], x["beta"], impl=impl, write_key=x["write_key"],
        log_decay=x.get("log_decay"), initial_state=x["initial_state"], output_final_state=True,
        cu_seqlens=cu_seqlens, chunk_size=chunk), inputs)


def test_registered():
    supports, kernel = REGISTRY["delta_rule"]
    assert kernel is delta_rule_pallas
    assert supports(K=128, V=128, dtype=jnp.bfloat16, decay=4)
    assert not supports(K=256, V=128, dtype=jnp.bfloat16, decay=None)


@pytest.mark.parametrize("decay", DECAYS)
def test_matches_reference(decay):
    """Forward, final state and all gradients (initial state included), odd T, all decays."""
    x = make_inputs(0, decay)
    assert_runs_match(run("pallas", x), run("reference", x), 2e-5)


@pytest.mark.parametrize("decay", DECAYS)
def test_similar_keys_match_reference(decay):
    """Keys of mean cosine ~0.7 in chunks of 64 (L = strict_tril(β K K̃ᵀ) with entries ~0.5, where
    the doubling product's powers of L grew to ~1e7 and its float32 inverse was off by O(1):
    outputs 8.7 % off at mean cosine 0.3, 775 % at 0.4): forward, final state and all gradients
    as tight as with independent keys. The decays are mild (-0.025 to -0.0005 a token, as
    trained gates), so they do not shrink L away."""
    x = make_inputs(1, decay, t=150, k_dim=32, similar=1.5)
    if "log_decay" in x:
        x["log_decay"] = x["log_decay"] * 0.05
    assert_runs_match(run("pallas", x, chunk=64), run("reference", x, chunk=64), 2e-5)


@pytest.mark.parametrize("decay", DECAYS)
def test_packed_documents(decay):
    """cu_seqlens: every state restarts at a document boundary, one initial state per document."""
    cu = jnp.asarray([0, 5, 22, 37], jnp.int32)
    x = make_inputs(1, decay, b=1, n_init=3)
    assert_runs_match(run("pallas", x, cu), run("reference", x, cu), 2e-5)


def test_padded_head_dims():
    """Head dims that are not powers of two are zero-padded inside the op."""
    x = make_inputs(2, "vector", k_dim=24, v_dim=20)
    assert_runs_match(run("pallas", x), run("reference", x), 2e-5)


def test_bf16_inputs():
    """bf16 inputs with float32 dots and storage throughout (``parallel_precision="tf32"``, exact
    float32 in interpret mode, ``state_dtype="float32"``): same answer as the reference on the
    same (bf16-valued) inputs up to one bf16 rounding of each output and gradient (gradients
    summed before one cast). The defaults for 16-bit inputs, bf16 dots in the chunk-parallel
    kernels and bf16 state storage, are held to FLA's bars in test_pallas_precision.py."""
    x = make_inputs(3, "scalar", dtype=jnp.bfloat16)
    got = fixed_loss_run(lambda x: delta_rule_pallas(
        x["q"], x["k"], x["write_key"], x["v"], x["beta"], x["log_decay"], K ** -0.5,
        x["initial_state"], None, C, Options(parallel_precision="tf32", state_dtype="float32")), x)
    want = run("reference", x)
    assert got[2]["q"].dtype == jnp.bfloat16
    assert_runs_match(got, want, 4e-3)


@pytest.mark.heavy
def test_vmap_and_checkpoint():
    x = make_inputs(4, "scalar")

    def loss(q, k, v, beta, g):
        o, final = pla.delta_rule(q, k, v, beta, log_decay=g, impl="pallas", chunk_size=C,
                                  output_final_state=True)
        return jnp.sum(jnp.sin(o)) + jnp.sum(final ** 2)

    args = (x["q"], x["k"], x["v"], x["beta"], x["log_decay"])
    split = [a.reshape(B, 1, *a.shape[1:]) for a in args]
    assert_vmap_matches_loop(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), split)
    plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(remat, plain):
        np.testing.assert_array_equal(a, b)


def test_second_run_bitwise_identical():
    x = make_inputs(5, "vector")
    assert_repeats_bitwise(lambda: run("pallas", x))


def test_traced_scale_and_no_state():
    """A scale traced under jit is folded into q; no initial state, no final state."""
    x = make_inputs(6, "none")

    def out(impl, scale):
        o, final = pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["write_key"],
                                  scale=scale, impl=impl, chunk_size=C)
        assert final is None
        return o

    got = jax.jit(lambda s: out("pallas", s))(jnp.float32(0.3))
    assert_close(got, out("reference", 0.3), 2e-5, "o")


def test_unsupported_calls_raise():
    x = make_inputs(7, "none", k_dim=256)
    with pytest.raises(ValueError, match="K <= 128"):
        pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], impl="pallas")
    y = make_inputs(7, "none")
    with pytest.raises(ValueError, match="chunk_size"):
        pla.delta_rule(y["q"], y["k"], y["v"], y["beta"], impl="pallas", chunk_size=24)


@pytest.mark.parametrize("opts", [
    Options(split=False), Options(save_wy=False),
    Options(block_v=32, serial_block_v=16, output_in_serial=True, dout_in_serial=True)],
    ids=["fused", "recompute_wy", "in_serial"])
@pytest.mark.parametrize("decay", DECAYS)
def test_kernel_options_match_reference(decay, opts):
    """The fused pipeline (the measured baseline), the split one that recomputes the WY
    tensors in the backward (instead of keeping the forward's) and the split one with outputs
    and dO products formed inside the serial passes on narrower serial tiles stay exact too."""
    x = make_inputs(3, decay)
    got = fixed_loss_run(lambda x: delta_rule_pallas(
        x["q"], x["k"], x["write_key"], x["v"], x["beta"], x.get("log_decay"), K ** -0.5,
        x["initial_state"], None, C, opts), x)
    assert_runs_match(got, run("reference", x), 2e-5)


@pytest.mark.parametrize("vector_wy, save_wy, wy_block_k", [
    ("kernel", True, None), ("kernel", False, 16), ("xla", True, None), ("halving", True, None)],
    ids=["kernel_saved_wy", "kernel_recompute_wy_own_key_tile", "xla", "halving"])
def test_vector_wy_matches_reference(vector_wy, save_wy, wy_block_k):
    """The per-channel-decay WY step and its pullback as kernels (``vector_wy="kernel"``, the
    default; ``"halving"``, the ablation) or in plain JAX (``"xla"``), packed documents with
    initial states, padded head dims (K = 24, V = 20); once with the WY kernels' own key tile
    (16: two tiles of the padded 32)."""
    cu = jnp.asarray([0, 5, 22, 37], jnp.int32)
    x = make_inputs(8, "vector", b=1, k_dim=24, v_dim=20, n_init=3)
    opts = Options(vector_wy=vector_wy, save_wy=save_wy, wy_block_k=wy_block_k)
    got = fixed_loss_run(lambda x: delta_rule_pallas(
        x["q"], x["k"], x["write_key"], x["v"], x["beta"], x["log_decay"], 24 ** -0.5,
        x["initial_state"], cu, C, opts), x)
    assert_runs_match(got, run("reference", x, cu), 2e-5)
    with pytest.raises(ValueError, match="vector_wy"):
        Options(vector_wy="triton")
    for name, bad in [("block_k", 24), ("wy_block_k", 8), ("block_v", None), ("block_v", 48),
                      ("serial_block_v", True)]:
        with pytest.raises(ValueError, match=f"Options.{name} must be a power of two"):
            Options(**{name: bad})


def token_scan_float64(x):
    """(o, final) of the delta core by ``delta_step`` over the tokens in float64 (call inside
    ``jax.enable_x64``; dense rows, one initial state per row, scale K^-1/2)."""
    def step(S, t):
        S, o, _, _ = delta_step(S, *t, x["q"].shape[-1] ** -0.5)
        return S, o

    xs = tuple(jnp.swapaxes(x[n], 0, 1) for n in ("q", "k", "write_key", "v", "beta", "log_decay"))
    final, o = jax.lax.scan(step, x["initial_state"], xs)
    return jnp.swapaxes(o, 0, 1), final


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_dg_where_chunks_decay_away(impl, decay):
    """Decays of 11-19 a token, T = 70 (C = 16: a padded last chunk): dL/dg is ~e^-11 of the
    terms it is formed from. K̃' = K̃ ⊙ Γ_C/Γ enters through σ = Σ_{t>i} g_t (``suffix_sums``),
    not γ_C − γ, whose two shares of dg cancelled on the last real row of a padded chunk
    (1e-2 relative before): every gradient within 1e-5 of a float64 token scan."""
    x = make_inputs(7, decay, b=1, t=70, n_init=1)
    x["log_decay"] = -(11.0 + 8.0 * jnp.asarray(
        np.random.default_rng(8).uniform(size=x["log_decay"].shape), jnp.float32))
    got = run(impl, x)
    with jax.enable_x64(True):
        want = fixed_loss_run(token_scan_float64, {n: a.astype(jnp.float64) for n, a in x.items()})
    assert_close(got[0], want[0], 1e-5, "output")
    assert_close(got[1], want[1], 1e-5, "final state")
    for name, grad in want[2].items():
        assert_close(got[2][name], grad, 1e-5, f"d{name}")
