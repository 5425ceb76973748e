"""benchmarks/kernel_times.py: device time by kernel from a jax.profiler trace."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import kernel_times


def write_trace(path, events):
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_sums_the_device_streams_by_kernel(tmp_path):
    """Only complete events on the GPU process's stream threads count (not its "XLA Ops" line
    nor the host's), summed by name, per step, largest first, the rest in one line."""
    meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
            dict(ph="M", pid=2, name="process_name", args=dict(name="/host:CPU")),
            dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #13(Compute)")),
            dict(ph="M", pid=1, tid=8, name="thread_name", args=dict(name="XLA Ops")),
            dict(ph="M", pid=2, tid=9, name="thread_name", args=dict(name="tf_XLAEigen"))]
    x = lambda name, dur, tid, pid=1: dict(ph="X", pid=pid, tid=tid, name=name, dur=dur, ts=0)  # noqa: E731
    events = meta + [x("gemm", 3000, 7), x("gemm", 1000, 7), x("scan", 2000, 7), x("tiny", 1000, 7),
                     x("gemm", 50000, 8), x("host", 90000, 9, pid=2)]
    write_trace(tmp_path / "plugins" / "profile" / "run", events)
    lines = kernel_times.kernel_table(kernel_times.trace_events(str(tmp_path)), top=2, steps=2)
    assert lines[1].split() == ["1.0", "2.000", "57.1", "gemm"]
    assert lines[2].split() == ["0.5", "1.000", "28.6", "scan"]
    assert lines[3].split() == ["0.500", "14.3", "(1", "others)"]
    assert lines[4].split() == ["3.500", "100.0", "total"]


def test_reads_a_real_host_trace(tmp_path):
    """On a machine without a GPU, the host's XLA threads of a real trace."""
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        f(x).block_until_ready()
    lines = kernel_times.kernel_table(kernel_times.trace_events(str(tmp_path)))
    assert lines[-1].split()[-1] == "total" and float(lines[-1].split()[0]) > 0


def test_missing_or_empty_traces_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz"):
        kernel_times.trace_events(str(tmp_path))
    write_trace(tmp_path / "t", [])
    with pytest.raises(ValueError, match="holds no kernel events"):
        kernel_times.trace_events(str(tmp_path))


def test_idle_table_sums_the_gaps_between_busy_streams(tmp_path):
    """Idle time is what no stream covers: overlapping events on two streams leave no gap, a
    kernel nested in a longer one does not end the busy span, gaps group by their neighbours."""
    meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
            dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #13(Compute)")),
            dict(ph="M", pid=1, tid=8, name="thread_name", args=dict(name="Stream #14(Memcpy)"))]
    x = lambda name, ts, dur, tid=7: dict(ph="X", pid=1, tid=tid, name=name, ts=ts, dur=dur)  # noqa: E731
    events = meta + [x("a", 0, 100), x("copy", 50, 100, tid=8), x("b", 400, 100), x("c", 420, 10, tid=8),
                     x("a", 700, 100), x("b", 1100, 100)]
    write_trace(tmp_path / "t", events)
    lines = kernel_times.idle_table(kernel_times.trace_events(str(tmp_path)), top=5, steps=2)
    assert lines[0].startswith("idle 0.375 ms/step of a 0.600 ms window (62.5 %)")
    assert [line.split() for line in lines[2:]] == [["0.5", "0.150", "a", "->", "b"],
                                                    ["0.5", "0.125", "copy", "->", "b"],
                                                    ["0.5", "0.100", "b", "->", "a"]]


def test_diff_table_by_kind(tmp_path):
    """Two traces compared by kind (fusion names without their numbers): the largest
    difference first, a kind in one trace only counted against zero, the totals last."""
    meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
            dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #13(Compute)"))]
    x = lambda name, dur: dict(ph="X", pid=1, tid=7, name=name, dur=dur, ts=0)  # noqa: E731
    write_trace(tmp_path / "a", meta + [x("loop_fusion_3", 2000), x("loop_fusion_12", 1000),
                                        x("osgm_fwd", 4000), x("gemm", 5000)])
    write_trace(tmp_path / "b", meta + [x("loop_fusion_7", 1000), x("gemm", 5000)])
    events, other = (kernel_times.trace_events(str(tmp_path / n)) for n in "ab")
    lines = kernel_times.diff_table(events, other, top=2)
    assert lines[1].split() == ["+4.000", "4.000", "1.0", "0.000", "0.0", "osgm_fwd"]
    assert lines[2].split() == ["+2.000", "3.000", "2.0", "1.000", "1.0", "loop_fusion"]
    assert lines[3].split() == ["+6.000", "12.000", "6.000", "total"]
    assert kernel_times.kind("input_transpose_fusion.407") == "input_transpose_fusion"


def test_bench_train_prints_each_model_against_the_first(tmp_path):
    """``bench_train.profile_diffs``: one table a model after the first, from the newest trace
    in each model's directory, per step of the PROFILE_STEPS traced."""
    from benchmarks import bench_train
    meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
            dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #13(Compute)"))]
    x = lambda name, dur: dict(ph="X", pid=1, tid=7, name=name, dur=dur, ts=0)  # noqa: E731
    steps = bench_train.PROFILE_STEPS
    write_trace(tmp_path / "none" / "run", meta + [x("gemm", 3000 * steps)])
    write_trace(tmp_path / "osgm" / "run", meta + [x("gemm", 3000 * steps), x("osgm_fwd", 1000 * steps)])
    lines = bench_train.profile_diffs(str(tmp_path), "m", ["none", "osgm"])
    assert lines[0] == "m/osgm against m/none: device time by kind, a step"
    assert lines[2].split() == ["+1.000", "1.000", "0.3", "0.000", "0.0", "osgm_fwd"]  # 1 call
    assert lines[-1].split()[0] == "+1.000" and len(lines) == 5
