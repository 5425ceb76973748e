"""Where ``wy_vector_mosaic``'s forward spends a chunk: Mosaic GPU's profiler on the kernel alone
(``state_mosaic.profiled``), its regions the kernel's named scopes (``flag``, ``grams_whole``,
``grams_halves`` or ``grams_exact``, ``inverse`` with its merges, ``outputs``; the rest is the
loads and the stores' wait). A GPU run, not a CPU one:

    PYTHONPATH=. python benchmarks/profile_wy_vector.py [--shape 8 2048 8 128]
        [--gates mild,layer] [--warm 20]

bench_delta's KDA inputs (``make_inputs``) with γ the in-chunk cumsum of their gates, and the
kernel's unprofiled time (a mean over ``--warm`` calls) next to each table: the profiler's own
cost (~190 ns an event, benchmarks/profile_mosaic.py) inflates the short regions.
"""

import argparse
import glob
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_delta import make_inputs
from benchmarks.profile_mosaic import print_table, region_times
from pallas_kernels import state_mosaic, wy_vector_mosaic
from precond_linattn.chunked.delta import decay_sums


def kernel_inputs(shape, gates):
    """(q, k, k̃, v, β, γ) in the kernel's layout for bench_delta's inputs at ``gates``."""
    B, T, H, K = shape
    x, _ = make_inputs(jax.random.PRNGKey(0), B, T, H, K, 4, jnp.bfloat16, gates=gates)
    g = x["g"].reshape(B, T // 64, 64, H, K)
    gamma = decay_sums(g, 2)[0].reshape(B, T, H, K)
    return x["q"], x["k"], x["kw"], x["v"], x["beta"].astype(jnp.float32), gamma


def profile(ins, directory, warm):
    """(unprofiled ms a call, ``region_times`` of one profiled call)."""
    call = jax.jit(lambda *a: wy_vector_mosaic.wy_vector_fwd(*a, interpret=False))
    jax.block_until_ready(call(*ins))
    start = time.perf_counter()
    for _ in range(warm):
        out = call(*ins)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - start) / warm * 1e3
    directory = tempfile.mkdtemp(dir=directory)
    with state_mosaic.profiled(directory, ranges=16):
        profiled = jax.jit(lambda *a: wy_vector_mosaic.wy_vector_fwd(*a, interpret=False))
        jax.block_until_ready(profiled(*ins))
    jax.effects_barrier()
    paths = sorted(glob.glob(os.path.join(directory, "*.json")))
    with open(paths[0]) as fh:
        return ms, region_times(json.load(fh)["traceEvents"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 2048, 8, 128])
    ap.add_argument("--gates", default="mild,layer")
    ap.add_argument("--warm", type=int, default=20)
    a = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="wy_vector_profile_")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, bf16 "
          f"{'x'.join(map(str, a.shape))}, traces in {directory}")
    for gates in a.gates.split(","):
        ms, per_cta = profile(kernel_inputs(a.shape, gates), directory, a.warm)
        print_table(f"wy_vector_mosaic ({gates} gates), unprofiled {ms:.3f} ms a call", per_cta)


if __name__ == "__main__":
    main()
