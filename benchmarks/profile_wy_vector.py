"""Where the per-channel WY kernels spend a chunk: Mosaic GPU's profiler on ``wy_vector_mosaic``'s
forward or ``wy_vector_pullback_mosaic`` alone (``state_mosaic.profiled``), its regions the
kernel's named scopes (the forward's ``flag``, ``grams_whole``, ``grams_halves`` or
``grams_exact``, ``inverse`` with its merges, ``outputs``; the pullback's ``dT``, ``dL`` and per
slab ``flag``, ``grams_<path>``, ``outputs``, ``cumsum``; the rest is the loads and the stores'
wait), with the share of chunks (forward) or slabs (pullback) on each path. A GPU run:

    PYTHONPATH=. python benchmarks/profile_wy_vector.py [--shape 8 2048 8 128]
        [--gates mild,layer] [--kernels fwd,bwd] [--warm 20]

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
from pallas_kernels import state_mosaic, wy_vector_mosaic, wy_vector_pullback_mosaic
from precond_linattn.chunked.delta import decay_sums


def kernel_inputs(shape, gates):
    """(q, k, k̃, v, β, γ) in the kernel's layout for bench_delta's inputs at ``gates``."""
    B, T, H, K = shape
    x, _ = make_inputs(jax.random.PRNGKey(0), B, T, H, K, 4, jnp.bfloat16, gates=gates)
    g = x["g"].reshape(B, T // 64, 64, H, K)
    gamma = decay_sums(g, 2)[0].reshape(B, T, H, K)
    return x["q"], x["k"], x["kw"], x["v"], x["beta"].astype(jnp.float32), gamma


def pullback_inputs(ins):
    """``ins`` with the forward's T (bf16) and random cotangents of its outputs: the pullback's
    arguments."""
    *outs, T = jax.jit(lambda *a: wy_vector_mosaic.wy_vector_fwd(
        *a, interpret=False, t_dtype=jnp.bfloat16))(*ins)
    keys = jax.random.split(jax.random.PRNGKey(1), len(outs))
    cts = [jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype)
           for key, x in zip(keys, outs)]
    return (*ins, T, *cts)


def path_shares(kernel, gamma):
    """The share of chunks (forward) or 64-column slabs (pullback) on each of the kernel's
    paths, as text."""
    if kernel == "bwd":
        names, paths = ("whole", "halves", "quarters", "exact"), wy_vector_pullback_mosaic.paths(gamma)
    else:
        names, paths = ("whole", "halves", "exact"), wy_vector_mosaic.paths(gamma)
    return ", ".join(f"{name} {float(jnp.mean(paths == n)):.1%}" for n, name in enumerate(names))


def profile(kernel, ins, directory, warm):
    """(unprofiled ms a call, ``region_times`` of one profiled call) of the forward ("fwd") or
    the pullback ("bwd") at ``ins``."""
    fn = (wy_vector_mosaic.wy_vector_fwd if kernel == "fwd"
          else wy_vector_pullback_mosaic.wy_vector_bwd)
    call = jax.jit(lambda *a: fn(*a, interpret=False))
    jax.block_until_ready(call(*ins))
    start = time.perf_counter()
    for _ in range(warm):
        out = call(*ins)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - start) / warm * 1e3
    directory = tempfile.mkdtemp(dir=directory)
    with state_mosaic.profiled(directory, ranges=32):
        profiled = jax.jit(lambda *a: fn(*a, interpret=False))
        jax.block_until_ready(profiled(*ins))
    jax.effects_barrier()
    paths = sorted(glob.glob(os.path.join(directory, "*.json")))
    with open(paths[0]) as fh:
        return ms, region_times(json.load(fh)["traceEvents"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 2048, 8, 128])
    ap.add_argument("--gates", default="mild,layer")
    ap.add_argument("--kernels", default="fwd", help="fwd, bwd (the pullback) or both")
    ap.add_argument("--warm", type=int, default=20)
    a = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="wy_vector_profile_")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, bf16 "
          f"{'x'.join(map(str, a.shape))}, traces in {directory}")
    for gates in a.gates.split(","):
        ins = kernel_inputs(a.shape, gates)
        for kernel in a.kernels.split(","):
            args = ins if kernel == "fwd" else pullback_inputs(ins)
            ms, per_cta = profile(kernel, args, directory, a.warm)
            print_table(f"{kernel} ({gates} gates; {path_shares(kernel, ins[5])}), unprofiled "
                        f"{ms:.3f} ms a call", per_cta)


if __name__ == "__main__":
    main()
