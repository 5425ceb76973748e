"""Where the OSGM Mosaic kernels spend a tile: Mosaic GPU's profiler on ``osgm_fwd`` and
``osgm_bwd`` (``state_mosaic.profiled``), each region a ``jax.named_scope`` of the kernels
(the forward's ``squares``, ``guess``, ``sweep``, ``row_sums``, ``emit``; the backward's
``squares``, ``recompute``, ``sweep``, ``row_sums``, ``dr``, ``gradients``; the tile loop's
``wait_in``, ``wait_out``, ``store``). A GPU run, not a CPU one:

    PYTHONPATH=. python benchmarks/profile_mosaic.py [--shape 8 2048 8 128] [--dir DIR]
        [--retention apf,none] [--warm 50]

bench_osgm's inputs (unit keys, β = σ(x), η = 0.003) with APF retention σ(x + 6) ("apf") and
without ("none": OSDN's default, whose tiles may take more sweeps). For each kernel: per CTA
(one warpgroup each), the mean over CTAs of each region's count and total µs, its mean µs an
occurrence, and its share of the CTA's span (first to last event); the rest of the span is
code outside every region. The profiler's own cost is large: runs 122 and 123 read the
forward's span as 268.6 µs a CTA, cold and warm alike, against the unprofiled kernel's 0.136
ms, i.e. ~190 ns an event (~22 events a tile), so short regions' shares are inflated: read
them as an ordering, not as costs (``probe_sweeps.py``'s fixed-sweep ablations measure
costs). The traces (Perfetto JSON, one a kernel) stay in DIR.
"""

import argparse
import collections
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.bench_osgm import make_inputs, phase1
from pallas_kernels import state_mosaic


def region_times(events):
    """{warpgroup trace id: ({region: [durations µs]}, span µs)} from a trace's events (the
    ``traceEvents`` of Mosaic GPU's profiler dump: "B" / "E" pairs, ``ts`` in µs, nested
    regions closed in order)."""
    open_ = collections.defaultdict(list)
    regions = collections.defaultdict(lambda: collections.defaultdict(list))
    stamps = collections.defaultdict(list)
    for e in events:
        tid = e["tid"]
        stamps[tid].append(e["ts"])
        if e["ph"] == "B":
            open_[tid].append(e)
            continue
        begin = open_[tid].pop()
        if begin["name"] != e["name"]:
            raise ValueError(f"trace {tid}: {e['name']!r} closes {begin['name']!r}")
        regions[tid][e["name"]].append(e["ts"] - begin["ts"])
    return {tid: (regions[tid], max(ts) - min(ts)) for tid, ts in stamps.items()}


def summary(per_cta):
    """Rows (region, count a CTA, µs a CTA, µs an occurrence, share of the span) averaged over
    the CTAs of ``region_times``' result, longest first, and the mean span µs."""
    n = len(per_cta)
    span = sum(s for _, s in per_cta.values()) / n
    names = {name for regions, _ in per_cta.values() for name in regions}
    rows = []
    for name in names:
        count = sum(len(r.get(name, ())) for r, _ in per_cta.values()) / n
        total = sum(sum(r.get(name, ())) for r, _ in per_cta.values()) / n
        rows.append((name, count, total, total / count if count else 0.0, total / span))
    return sorted(rows, key=lambda r: -r[2]), span


def kernel_of(regions):
    """Which kernel a trace is: the backward has ``gradients``, the forward ``emit``."""
    return "osgm_bwd" if "gradients" in regions else "osgm_fwd" if "emit" in regions else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 2048, 8, 128])
    ap.add_argument("--dir", default=None, help="where the traces go (default: a new temporary one)")
    ap.add_argument("--retention", default="apf,none", help="apf, none or both (comma-separated)")
    ap.add_argument("--warm", type=int, default=50,
                    help="unprofiled calls before the profiled one (clocks up, caches warm)")
    a = ap.parse_args()
    cases = a.retention.split(",")
    if not cases or set(cases) - {"apf", "none"}:
        ap.error(f"--retention takes apf, none or both, got {a.retention!r}")
    directory = a.dir or tempfile.mkdtemp(prefix="osgm_profile_")
    os.makedirs(directory, exist_ok=True)
    B, T, H, K = a.shape
    x, _ = make_inputs(jax.random.PRNGKey(0), B, T, H, K, jnp.bfloat16)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, bf16 "
          f"{'x'.join(map(str, a.shape))}, traces in {directory}")
    for case in cases:
        found = traces(x, phase1("pallas", apf=case == "apf"), directory, T, a.warm)
        if not found:
            print(f"{case}: no traces (the profiler runs on a GPU only, not in interpret mode)")
        for name, per_cta in found:
            print_table(f"{name} ({case})", per_cta)


def traces(x, f, directory, T, warm):
    """(kernel, ``region_times``) of each Mosaic kernel in one warm gradient of ``f``'s
    outputs with respect to k, β and r, profiled into a new subdirectory of ``directory``.
    A profiled kernel names its trace file when it is lowered and keeps only its first
    execution's (a later one finds the file there): so the profiled gradient is compiled
    first (``profiled`` clears JAX's caches around it, so its kernels are lowered anew), the
    GPU warmed by ``warm`` calls of the unprofiled one, then the profiled one runs once."""
    def loss(k, beta, r):
        kw, final = f({**x, "k": k, "beta": beta, "r": r})
        return jnp.sum(kw.astype(jnp.float32) ** 2) + jnp.sum(final)

    args = (x["k"], x["beta"], x["r"])
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    directory = tempfile.mkdtemp(dir=directory)
    # ~10 ranges a forward tile, ~13 a backward one at the bench's ~2.2 / ~3.1 sweeps a tile
    with state_mosaic.profiled(directory, ranges=24 * -(-T // 64)):
        profiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    for _ in range(warm):
        out = grad(*args)
    jax.block_until_ready(out)
    jax.block_until_ready(profiled(*args))
    jax.effects_barrier()  # the dumps are host callbacks
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as fh:
            per_cta = region_times(json.load(fh)["traceEvents"])
        out.append((kernel_of({n for r, _ in per_cta.values() for n in r}), per_cta))
    return out


def print_table(title, per_cta):
    """``summary``'s rows of one kernel's trace as a table."""
    rows, span = summary(per_cta)
    print(f"\n{title}: {len(per_cta)} CTAs, span {span:.1f} µs a CTA")
    print(f"{'region':12s} {'count':>7s} {'µs a CTA':>9s} {'µs each':>8s} {'share':>6s}")
    for region, count, total, each, share in rows:
        print(f"{region:12s} {count:7.1f} {total:9.1f} {each:8.3f} {share:6.1%}")
    rest = 1.0 - sum(r[4] for r in rows)
    print(f"{'(outside)':12s} {'':7s} {rest * span:9.1f} {'':8s} {rest:6.1%}")


if __name__ == "__main__":
    main()
