"""Device time by kernel, read from a ``jax.profiler`` trace: where a step's milliseconds go.

    python benchmarks/kernel_times.py TRACE_DIR [--top 25] [--steps N] [--idle] [--against DIR]

``TRACE_DIR`` is what ``jax.profiler.trace(TRACE_DIR, create_perfetto_trace=True)`` wrote; the
newest ``perfetto_trace.json.gz`` under it is read. The table sums the complete ("X") events of
the device's stream lines (process "/device:GPU:N", threads "Stream ..."; on a machine without a
GPU, the host's XLA threads instead, which is what the tests read) by event name, divided by
``--steps`` (the calls the trace holds), and prints the ``--top`` names with their share of the
total. ``--idle`` adds where the device waited: the time inside the traced window that no stream
was busy, per step, and the ``--top`` largest gaps grouped by the kernels before and after them
(a gap after a kernel that ends a host-side step, e.g. a while loop's condition, or before
a custom call the host launches late). ``--against DIR``: where the two traces' device time
differs, by kind of kernel (``kind``: XLA's fusion names without their numbers, which differ
from one compile to the next), the largest differences first: how one model's step spends
what another's does not (RESULTS run 180). ``bench_train.py --profile`` traces steps after
its timed ones and prints the first two tables per model.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re


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
    """(name, µs, start µs) of every complete event on the device's streams; without a device
    process, of the host's XLA threads (thread names starting "tf_XLA")."""
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = _names(events, "process"), _names(events, "thread")
    gpus = {p for p, n in processes.items() if n.startswith("/device:GPU")}
    if gpus:
        keep = lambda e: e["pid"] in gpus and threads.get(e.get("tid"), "").startswith("Stream")  # noqa: E731
    else:
        keep = lambda e: threads.get(e.get("tid"), "").startswith("tf_XLA")  # noqa: E731
    return [(e["name"], float(e["dur"]), float(e["ts"]))
            for e in events if e.get("ph") == "X" and keep(e)]


def trace_events(trace_dir):
    """``kernel_events`` of the newest trace under ``trace_dir`` (read once for both tables);
    ValueError if it holds none."""
    events = kernel_events(newest_trace(trace_dir))
    if not sum(us for _, us, _ in events):
        raise ValueError(f"the trace under {trace_dir!r} holds no kernel events")
    return events


def _sums(events, key=lambda name: name):
    """(µs, calls) Counters of ``trace_events`` by ``key(name)``."""
    totals, calls = collections.Counter(), collections.Counter()
    for name, us, _ in events:
        totals[key(name)] += us
        calls[key(name)] += 1
    return totals, calls


def kernel_table(events, top=25, steps=1):
    """Lines of a table of ``trace_events``: per name, calls and ms per step and % of the total,
    largest first, the rest summed in one line, then the total."""
    totals, calls = _sums(events)
    whole = sum(totals.values())
    lines = [f"{'calls':>6s} {'ms/step':>8s} {'%':>5s}  kernel"]
    ranked = totals.most_common()
    row = lambda n, us, what: f"{n:6s} {us / 1e3 / steps:8.3f} {100 * us / whole:5.1f}  {what}"  # noqa: E731
    lines += [row(f"{calls[name] / steps:6.1f}", us, name[:100]) for name, us in ranked[:top]]
    rest = sum(us for _, us in ranked[top:])
    if rest:
        lines.append(row("", rest, f"({len(ranked) - top} others)"))
    lines.append(row("", whole, "total"))
    return lines


def idle_table(events, top=10, steps=1):
    """Lines of ``trace_events``: the device's idle ms per step inside the traced window (no
    event on any stream), then the ``top`` (kernel before -> kernel after) pairs by the idle
    time between them."""
    events = sorted(events, key=lambda e: e[2])
    gaps, calls = collections.Counter(), collections.Counter()
    last_name, busy_until = events[0][0], events[0][2] + events[0][1]
    for name, us, start in events[1:]:
        if start > busy_until:
            pair = f"{last_name[:45]} -> {name[:45]}"
            gaps[pair] += start - busy_until
            calls[pair] += 1
        if start + us >= busy_until:
            last_name, busy_until = name, start + us
    window = busy_until - events[0][2]
    idle = sum(gaps.values())
    lines = [f"idle {idle / 1e3 / steps:.3f} ms/step of a {window / 1e3 / steps:.3f} ms window "
             f"({100 * idle / window:.1f} %); largest gaps:",
             f"{'gaps':>6s} {'ms/step':>8s}  kernel before -> kernel after"]
    lines += [f"{calls[p] / steps:6.1f} {us / 1e3 / steps:8.3f}  {p}" for p, us in gaps.most_common(top)]
    return lines


def kind(name):
    """A kernel's name without XLA's numbering: "input_transpose_fusion_239" ->
    "input_transpose_fusion" (a kernel of one's own keeps its name)."""
    return re.sub(r"[._]\d+$", "", name)


def diff_table(events, other, top=25, steps=1):
    """Lines of a table: per ``kind``, ms per step and calls in ``events`` and in ``other``
    (both ``trace_events``, ``steps`` steps each) and their difference, the ``top`` largest
    differences first, then the totals."""
    (us, calls), (us0, calls0) = _sums(events, kind), _sums(other, kind)
    ms = {k: us[k] / 1e3 / steps for k in set(us) | set(us0)}
    ms0 = {k: us0[k] / 1e3 / steps for k in ms}
    ranked = sorted(ms, key=lambda k: -abs(ms[k] - ms0[k]))
    lines = [f"{'diff ms':>8s} {'ms':>8s} {'calls':>6s} {'other ms':>8s} {'calls':>6s}  kind"]
    lines += [f"{ms[k] - ms0[k]:+8.3f} {ms[k]:8.3f} {calls[k] / steps:6.1f} {ms0[k]:8.3f} "
              f"{calls0[k] / steps:6.1f}  {k[:90]}" for k in ranked[:top]]
    total, total0 = sum(ms.values()), sum(ms0.values())
    lines.append(f"{total - total0:+8.3f} {total:8.3f} {'':6s} {total0:8.3f} {'':6s}  total")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=1, help="calls the trace holds (per-step times)")
    ap.add_argument("--idle", action="store_true", help="also the device's idle time and its gaps")
    ap.add_argument("--against", metavar="DIR", help="also the difference by kind from this "
                    "trace (as many steps)")
    a = ap.parse_args(argv)
    events = trace_events(a.trace_dir)
    print("\n".join(kernel_table(events, a.top, a.steps)))
    if a.idle:
        print("\n".join(idle_table(events, a.top, a.steps)))
    if a.against:
        print("\n".join(diff_table(events, trace_events(a.against), a.top, a.steps)))


if __name__ == "__main__":
    main()
