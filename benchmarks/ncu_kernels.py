"""Device time of every kernel one call launches, read by Nsight Compute (ncu) on the device.

    PYTHONPATH=. python3 benchmarks/ncu_kernels.py osgm --shape 1 2048 8 128 --grad
    PYTHONPATH=. python3 benchmarks/ncu_kernels.py delta --core gdn --variant auto/64/4 --grad [--jla]
    PYTHONPATH=. python3 benchmarks/ncu_kernels.py decode --preconditioner osgm --steps 4

The outer process runs itself under ``ncu --profile-from-start off --metrics
gpu__time_duration.sum --clock-control none --cache-control none``; the inner one (``--inner``)
compiles the call, runs it twice, times it (median of 10, as the benches do; under ncu, where
host round trips are slow: compare the benches' own wall times), then runs it once between
``cuProfilerStart`` / ``cuProfilerStop``. The table: each kernel name, its launches and
its summed device time, then the sum against the call's wall time; their difference is what the
kernels do not account for (launch gaps, host round trips such as a ``while_loop``'s predicate).
ncu serialises the kernels, so concurrent kernels would each count whole; XLA runs one stream.
Targets: ``osgm``: phase 1 (``bench_osgm.phase1`` with a ``bench_osgm.variant``), ``delta``:
the delta core (``bench_delta.op`` with a ``bench_delta.variant``; ``--jla``:
jax-linear-attention's kernel of the same backbone, ``bench_delta.jla_ops``); ``--grad``: forward and
backward (the gradients the benches take), else the forward; ``decode``: ``--steps`` decode steps
of ``--preset`` with ``--preconditioner`` at batch 1 (``bench_decode_step.decode_loop``, the
layers' defaults: the fused decode kernel on a GPU), every kernel of every step (``--tiny``: a
small model, the shape of a CPU check; the shape, variant and core arguments are not used).
"""

import argparse
import collections
import csv
import ctypes
import io
import os
import subprocess
import sys

METRIC = "gpu__time_duration.sum"


def build(args):
    """(jitted call, its inputs) for the target."""
    import jax
    import jax.numpy as jnp
    B, T, H, K = args.shape
    if args.target == "decode":
        from benchmarks.bench_decode_step import decode_loop
        from benchmarks.bench_generate import model_for
        return decode_loop(model_for(args.preset, args.preconditioner, tiny=args.tiny), args.steps)
    if args.target == "osgm":
        from benchmarks import bench_osgm
        x, _ = bench_osgm.make_inputs(jax.random.PRNGKey(0), B, T, H, K, jnp.bfloat16)
        f = bench_osgm.phase1("pallas", options=bench_osgm.variant(args.variant))
        if not args.grad:
            return jax.jit(lambda x: f(x)[0]), (x,)
        loss = lambda k, b, r: jnp.sum(f({**x, "k": k, "beta": b, "r": r})[0].astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (x["k"], x["beta"], x["r"])
    from benchmarks import bench_delta
    x, _ = bench_delta.make_inputs(jax.random.PRNGKey(0), B, T, H, K,
                                   bench_delta.DECAYS[args.core], jnp.bfloat16)
    f = (bench_delta.jla_ops()[args.core] if args.jla else
         bench_delta.op("pallas", bench_delta.variant(args.variant)))
    if not args.grad:
        return jax.jit(lambda x: f(x)[0]), (x,)
    return jax.jit(jax.grad(lambda x: jnp.sum(f(x)[0].astype(jnp.float32) ** 2))), (x,)


def _cuda(name, *args):
    """Call the driver API's ``name`` (libcuda), raising on a non-zero status."""
    status = getattr(ctypes.CDLL("libcuda.so.1"), name)(*args)
    if status:
        raise RuntimeError(f"{name} returned CUDA error {status}")


def inner(args):
    """Compile, time, then run the call once inside the profiler's range."""
    import jax
    from benchmarks.bench_delta import timeit
    fn, xs = build(args)
    print(f"wall_ms {timeit(fn, *xs, reps=10)}", flush=True)
    ctx = ctypes.c_void_p()  # the profiler range is the current context's: JAX's primary one
    _cuda("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    _cuda("cuCtxSetCurrent", ctx)
    _cuda("cuProfilerStart")
    jax.block_until_ready(fn(*xs))
    _cuda("cuProfilerStop")


def table(report: str, wall_ms: float | None):
    """The summary of ncu's CSV ``report``: (name, launches, µs) rows by time, and totals."""
    lines = report[report.find('"ID"'):] if '"ID"' in report else ""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for row in csv.DictReader(io.StringIO(lines)):
        if row.get("Metric Name") != METRIC:
            continue
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                 "msecond": 1e3}[row["Metric Unit"]]
        entry = by_name[row["Kernel Name"][:70]]
        entry[0] += 1
        entry[1] += float(row["Metric Value"].replace(",", "")) * scale
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    total = sum(us for _, us in by_name.values())
    out = [f"{'kernel':70s} {'n':>4s} {'us':>9s}"]
    out += [f"{name:70s} {n:4d} {us:9.1f}" for name, (n, us) in rows]
    out.append(f"{'sum of kernels':70s} {sum(n for n, _ in by_name.values()):4d} {total:9.1f}")
    if wall_ms is not None:
        out.append(f"{'wall time of the call (median, under ncu: host round trips slow)':70s} "
                   f"{'':4s} {wall_ms * 1e3:9.1f}")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("target", choices=("osgm", "delta", "decode"))
    p.add_argument("--shape", type=int, nargs=4, default=(8, 2048, 8, 128))
    p.add_argument("--variant", default=None)
    p.add_argument("--core", default="gdn", choices=("deltanet", "gdn", "kda"))
    p.add_argument("--grad", action="store_true")
    p.add_argument("--jla", action="store_true",
                   help="delta: jax-linear-attention's symmetric-key kernel of --core instead")
    p.add_argument("--preset", default="deltanet-340m", help="decode: the model")
    p.add_argument("--preconditioner", default="none", help="decode: the model's")
    p.add_argument("--steps", type=int, default=4, help="decode: steps in the call")
    p.add_argument("--tiny", action="store_true", help="decode: a small model")
    p.add_argument("--inner", action="store_true")
    p.add_argument("--ncu", default="ncu")
    args = p.parse_args()
    if args.variant is None:
        args.variant = "2/1/16/8/scalar/p4/cpauto" if args.target == "osgm" else "auto/64/4"
    if args.inner:
        return inner(args)
    cmd = [args.ncu, "--csv", "--print-units", "base", "--profile-from-start", "off",
           "--metrics", METRIC, "--clock-control", "none", "--cache-control", "none",
           sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--inner"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = [float(w.split()[1]) for w in run.stdout.splitlines() if w.startswith("wall_ms ")]
    if args.target == "decode":
        print(f"== decode {args.preset} {args.preconditioner} {args.steps} steps")
    else:
        print(f"== {args.target} {args.core if args.target == 'delta' else ''} "
              f"{'jla' if args.jla else args.variant} "
              f"shape {args.shape} {'fwd+bwd' if args.grad else 'fwd'}")
    if run.returncode or not wall:
        print(run.stdout[-3000:], run.stderr[-3000:])
        return run.returncode or 1
    print(table(run.stdout, wall[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
