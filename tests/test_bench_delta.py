"""bench_delta's variant strings (a device call is lost when one is misread): each parses to the
Options it names, and ``variant_tag`` writes it back."""

import argparse

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_delta
from benchmarks.bench_delta import DECAYS, breakdown, gates_arg, make_inputs, variant, variant_tag
from pallas_kernels.delta_rule import Options


@pytest.mark.parametrize("text, fields", [
    ("auto/64/4", {}),
    ("auto/64/4/2/mosaic/dserial/cp8", dict(serial_backend="mosaic", dout_in_serial=True,
                                            sequence_pieces=8)),
    ("auto/64/4/mosaic/fg", dict(serial_backend="mosaic", fused_grads=True)),
    ("auto/64/4/nofg", dict(fused_grads=False)),
    ("auto/64/4/mosaic/fg/gw1", dict(serial_backend="mosaic", fused_grads=True,
                                     grads_warpgroups=1)),
    ("auto/64/4/wybf16/watf32", dict(wy_precision="bf16", wy_apply_precision="tf32")),
    ("auto/64/4/wabf16/wis/invm", dict(wy_apply_precision="bf16", wy_in_serial=True,
                                       inverse_backend="mosaic")),
    ("auto/64/4/invm/ip2", dict(inverse_backend="mosaic", inverse_passes=2)),
    ("auto/64/4/ip1/infp", dict(inverse_passes=1, p_in_serial=False)),
    ("auto/64/4/serp", dict(p_in_serial=True)),
    ("auto/64/4/fw2", dict(forward_warpgroups=2)),
    ("auto/64/4/fw1", dict(forward_warpgroups=1)),
    ("auto/64/4/okernel/bw8/dkernel", dict(output_in_serial=False, pullback_warps=8,
                                           dout_in_serial=False)),
    ("tf32/32/8/1/triton/oserial/k128/s32", dict(precision="tf32", block_v=32, num_warps=8,
                                                  num_stages=1, serial_backend="triton",
                                                  output_in_serial=True, block_k=128,
                                                  serial_block_v=32)),
    ("auto/64/4/vhalving/k32/ww8", dict(vector_wy="halving", block_k=32, wy_warps=8)),
    ("auto/64/4/wk32/bw8/vkernel", dict(wy_block_k=32, pullback_warps=8, vector_wy="kernel")),
    ("auto/64/4/dsx", dict(decay_scan="xla")),
    ("auto/64/4/vhalving/dsm", dict(vector_wy="halving", decay_scan="mosaic")),
    ("auto/64/4/vmosaic/wbf16", dict(vector_wy="mosaic", wy_dtype="bfloat16")),
    ("auto/64/4/vmosaic/vpull", dict(vector_wy="mosaic", vector_pullback="mosaic")),
    ("auto/64/4/vmosaic/vkpull", dict(vector_wy="mosaic", vector_pullback="kernel")),
    ("auto/64/4/fused/recompute/vxla/pbf16/hbf16/wbf16/qbf16",
     dict(split=False, save_wy=False, vector_wy="xla", parallel_precision="bf16",
          state_dtype="bfloat16", wy_dtype="bfloat16", serial_precision="bf16")),
])
def test_variant_strings_round_trip(text, fields):
    options = variant(text)
    assert options == Options(**fields)
    assert variant(variant_tag(options)) == options


def test_gates_argument():
    """``--gates``: mild, layer or const:R with R > 0 (const gives every KDA key tile one path);
    anything else is refused before the device call starts."""
    assert [gates_arg(t) for t in ("mild", "layer", "const:2.5")] == ["mild", "layer", "const:2.5"]
    for bad in ("strong", "const:", "const:x", "const:-1", "const:0"):
        with pytest.raises(argparse.ArgumentTypeError, match="--gates"):
            gates_arg(bad)
    x, _ = make_inputs(jax.random.key(0), 1, 16, 2, 16, 4, jnp.float32, gates="const:2.5")
    assert x["g"].shape == (1, 16, 2, 16) and bool(jnp.all(x["g"] == -2.5))


@pytest.mark.parametrize("core", ["deltanet", "kda"])
def test_breakdown_runs(core):
    """``--sections breakdown`` times every kernel of the split pipeline at a tiny shape in
    interpret mode: it runs, so a device call does not find it broken."""
    x, _ = make_inputs(jax.random.key(1), 1, 128, 1, 16, DECAYS[core], jnp.float32,
                       gates="const:2")
    r = breakdown(core, x, 1, variant("auto/64/4"))
    steps = ["wy", "state_fwd", "chunk_output", "dout_products", "state_bwd", "chunk_grads",
             "wy_pullback"]
    assert [n for n in r if n.endswith("_ms")] == [f"{n}_ms" for n in steps]
    assert all(r[f"{n}_ms"] > 0 for n in steps)


@pytest.mark.parametrize("pipelined", [False, True])
def test_timeit_calls(monkeypatch, pipelined):
    """``timeit``: two warm-up calls, then ``reps`` timed ones, waited for one by one or queued
    (``--timing pipelined``); a time in milliseconds."""
    monkeypatch.setattr(bench_delta, "PIPELINED", [pipelined])
    calls = []

    def f(x):
        calls.append(1)
        return x + 1

    ms = bench_delta.timeit(f, jnp.ones(3), reps=5)
    assert len(calls) == 7 and isinstance(ms, float) and ms >= 0


def test_similar_keys():
    """``--similar s``: the keys of a (row, head) have mean cosine ~s² / (1 + s²) (independent
    unit keys ~0); the write key stays d ⊙ k."""
    def mean_cosine(s):
        x, _ = make_inputs(jax.random.key(0), 2, 256, 2, 64, 3, jnp.float32, similar=s)
        k = x["k"].transpose(0, 2, 1, 3)
        gram = k @ k.swapaxes(-1, -2)
        return float((gram.sum() - jnp.trace(gram, axis1=-2, axis2=-1).sum()) / (4 * 256 * 255))

    assert abs(mean_cosine(0.0)) < 0.02
    assert abs(mean_cosine(1.5) - 1.5 ** 2 / (1 + 1.5 ** 2)) < 0.1


def test_values_and_grads_takes_the_rounded_cotangents(little_poison):
    """The cotangents reach the pullback as drawn (the output's rounded to bf16) and are the
    same for every function of the same shapes: drawn outside the compiled program, so that no
    compiler can drop their rounding in one program and keep it in another (RESULTS run 208)."""
    x = {"a": jax.random.normal(jax.random.key(1), (3, 40), jnp.float32)}
    key = jax.random.key(2)

    def f(x):
        return 2.0 * x["a"], jnp.sum(x["a"], axis=1)

    def g(x):
        return x["a"] * 1.0, x["a"][:, 0] * 0.0

    out, final, grads = bench_delta.values_and_grads(f, x, key)
    ct_out, ct_final = bench_delta.cotangents(key, out, final)
    assert bool(jnp.all(ct_out.astype(jnp.bfloat16).astype(jnp.float32) == ct_out))
    assert bool(jnp.any(ct_out != jax.random.normal(jax.random.split(key)[0], out.shape)))
    assert bool(jnp.all(grads["a"] == 2.0 * ct_out + ct_final[:, None]))
    _, _, grads_g = bench_delta.values_and_grads(g, x, key)
    assert bool(jnp.all(grads_g["a"] == ct_out))


def test_values_and_grads_draws_the_cotangents_outside_the_program(monkeypatch, little_poison):
    """``cotangents`` runs outside any trace (on shapes), not inside the compiled program."""
    drawn = []

    def spy(key, o, final):
        drawn.append(isinstance(o, jax.core.Tracer) or isinstance(final, jax.core.Tracer))
        return cotangents(key, o, final)

    cotangents = bench_delta.cotangents
    monkeypatch.setattr(bench_delta, "cotangents", spy)
    x = {"a": jnp.arange(6.0).reshape(2, 3)}
    bench_delta.values_and_grads(lambda x: (x["a"], x["a"].sum(1)), x, jax.random.key(0))
    assert drawn == [False]
