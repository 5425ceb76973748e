"""Training throughput of the 340M presets on one device (issue 6's target): the jitted, donated
train step of ``train.step`` (AdamW, fp32 weights, bf16 compute) at 8 x 2048 tokens per step on
random tokens; 2 warm-up steps, then the median step time of ``--steps``; peak device memory.

    python benchmarks/bench_train.py [--preconditioners none osgm] [--remat] [--tied]
        [--mesh DATA FSDP TENSOR]   # several devices: --batch rows per data-parallel device
The anchors' shape is FLA's DeltaNet-340M: untied embeddings, 374.4M parameters (the default).
"""

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from precond_linattn.models import LanguageModel, count_params, preset
from train.build import flops_per_token
from train.optim import make_optimizer, osdn_recipe
from train.partitioning import annotate
from train.sharding import drop_mesh_axis, init_sharded, logical_sharding, make_mesh, state_shardings
from train.step import StepShardings, device_batch, make_train_step


def bench(name, preconditioner, batch, seq_len, steps, remat, tied, tiny, mesh_shape=(1, 1, 1)):
    """One model's step time on a (data, fsdp, tensor) mesh of the first prod(mesh_shape)
    devices, ``batch`` rows per data-parallel device (weak scaling: the global batch grows with
    the data and fsdp axes). Returns tokens/s in all and per device, and the largest peak device
    memory."""
    config = preset(name, preconditioner)
    config = dataclasses.replace(config, tie_embeddings=tied)
    if tiny:
        layer = dataclasses.replace(config.layer, hidden_size=128, num_heads=2, head_dim=64)
        config = dataclasses.replace(config, layer=layer, num_layers=2, intermediate_size=256,
                                     vocab_size=512)
    n_dev = int(np.prod(mesh_shape))
    mesh = make_mesh(*mesh_shape, devices=jax.devices()[:n_dev])
    batch = batch * mesh_shape[0] * mesh_shape[1]
    tx = make_optimizer(osdn_recipe(total_steps=20480), total_steps=20480)
    model = init_sharded(lambda: annotate(LanguageModel(config, rngs=nnx.Rngs(0))), mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_shardings = state_shardings(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    p_shardings = state_shardings(params, mesh)
    shardings = StepShardings(p_shardings, opt_shardings, drop_mesh_axis(p_shardings, "fsdp"),
                              logical_sharding(mesh, (None, "batch")),
                              NamedSharding(mesh, PartitionSpec()))
    step = make_train_step(graphdef, tx, shardings, remat=remat)
    rng = np.random.default_rng(0)

    def batch_():
        tokens = rng.integers(0, config.vocab_size, (batch, seq_len + 1), dtype=np.int32)
        rows = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                    cu_seqlens=np.tile(np.int32([0, seq_len]), (batch, 1)))  # one document a row
        return device_batch(rows, 1, shardings.batch)

    t0 = time.perf_counter()
    params, opt_state, m = step(params, opt_state, batch_())
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    params, opt_state, m = step(params, opt_state, batch_())
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        b = batch_()
        t0 = time.perf_counter()
        params, opt_state, m = step(params, opt_state, b)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    n = count_params(config)
    peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in mesh.devices.flat)
    return dict(model=f"{name}/{preconditioner}", params=n, step_ms=1e3 * t,
                tok_s=batch * seq_len / t, tok_s_dev=batch * seq_len / t / n_dev,
                peak_gib=peak / 2**30,
                tflops=flops_per_token(config, n) * batch * seq_len / t / 1e12,
                compile_s=compile_s, loss=float(m["loss"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="deltanet-340m")
    ap.add_argument("--preconditioners", nargs="+", default=["none", "osgm"])
    ap.add_argument("--batch", type=int, default=8, help="rows per data-parallel device")
    ap.add_argument("--mesh", type=int, nargs=3, default=(1, 1, 1), metavar=("DATA", "FSDP", "TENSOR"),
                    help="device mesh (the first DATA x FSDP x TENSOR devices)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a small model, a quick check on a CPU")
    a = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, remat={a.remat}, "
          f"mesh (data, fsdp, tensor) = {tuple(a.mesh)}")
    print(f"{'model':24s} {'params':>8s} {'step ms':>8s} {'tok/s':>9s} {'tok/s/dev':>9s} "
          f"{'TFLOP/s':>8s} {'peak GiB':>8s} {'compile s':>9s} {'loss':>7s}")
    for p in a.preconditioners:
        r = bench(a.preset, p, a.batch, a.seq_len, a.steps, a.remat, a.tied, a.tiny, a.mesh)
        print(f"{r['model']:24s} {r['params'] / 1e6:7.1f}M {r['step_ms']:8.1f} {r['tok_s']:9.0f} "
              f"{r['tok_s_dev']:9.0f} {r['tflops']:8.1f} {r['peak_gib']:8.2f} "
              f"{r['compile_s']:9.1f} {r['loss']:7.3f}", flush=True)


if __name__ == "__main__":
    main()
