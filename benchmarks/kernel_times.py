"""Device time by kernel, read from a ``jax.profiler`` trace: where a step's milliseconds go.

    python benchmarks/kernel_times.py TRACE_DIR [--top 25] [--steps N]

``TRACE_DIR`` is what ``jax.profiler.trace(TRACE_DIR, create_perfetto_trace=True)`` wrote; the
newest ``perfetto_trace.json.gz`` under it is read. The table sums the complete ("X") events of
the device's stream lines (process "/device:GPU:N", threads "Stream ..."; on a machine without a
GPU, the host's XLA threads instead, which is what the tests read) by event name, divided by
``--steps`` (the calls the trace holds), and prints the ``--top`` names with their share of the
total. ``bench_train.py --profile`` traces its timed steps and prints this table per model.
"""

import argparse
import collections
import glob
import gzip
import json
import os


def newest_trace(trace_dir):
    """The newest ``perfetto_trace.json.gz`` under ``trace_dir``."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir!r}: trace with "
                                "jax.profiler.trace(dir, create_perfetto_trace=True)")
    return max(paths, key=os.path.getmtime)


def _names(events, kind):
    """{id: name} of the trace's process_name (kind "process") or thread_name events."""
    key = "pid" if kind == "process" else "tid"
    return {e[key]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == f"{kind}_name"}


def kernel_events(path):
    """(name, µs) of every complete event on the device's streams; without a device process,
    of the host's XLA threads (thread names starting "tf_XLA")."""
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = _names(events, "process"), _names(events, "thread")
    gpus = {p for p, n in processes.items() if n.startswith("/device:GPU")}
    if gpus:
        keep = lambda e: e["pid"] in gpus and threads.get(e.get("tid"), "").startswith("Stream")  # noqa: E731
    else:
        keep = lambda e: threads.get(e.get("tid"), "").startswith("tf_XLA")  # noqa: E731
    return [(e["name"], float(e["dur"])) for e in events if e.get("ph") == "X" and keep(e)]


def kernel_table(trace_dir, top=25, steps=1):
    """Lines of a table: per name, calls and ms per step and % of the total, largest first,
    the rest summed in one line, then the total."""
    totals, calls = collections.Counter(), collections.Counter()
    for name, us in kernel_events(newest_trace(trace_dir)):
        totals[name] += us
        calls[name] += 1
    whole = sum(totals.values())
    if not whole:
        raise ValueError(f"the trace under {trace_dir!r} holds no kernel events")
    lines = [f"{'calls':>6s} {'ms/step':>8s} {'%':>5s}  kernel"]
    ranked = totals.most_common()
    row = lambda n, us, what: f"{n:6s} {us / 1e3 / steps:8.3f} {100 * us / whole:5.1f}  {what}"  # noqa: E731
    lines += [row(f"{calls[name] / steps:6.1f}", us, name[:100]) for name, us in ranked[:top]]
    rest = sum(us for _, us in ranked[top:])
    if rest:
        lines.append(row("", rest, f"({len(ranked) - top} others)"))
    lines.append(row("", whole, "total"))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=1, help="calls the trace holds (per-step times)")
    a = ap.parse_args(argv)
    print("\n".join(kernel_table(a.trace_dir, a.top, a.steps)))


if __name__ == "__main__":
    main()
