"""benchmarks/ncu_kernels.py's summary of Nsight Compute's CSV (the device run is the bench's)."""

from benchmarks.ncu_kernels import table

REPORT = """==PROF== Connected to process 1
"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","1","fusion_1","gpu__time_duration.sum","ns","1,500"
"1","1","osgm_sweep","gpu__time_duration.sum","us","20"
"2","1","fusion_1","gpu__time_duration.sum","nsecond","2500"
"3","1","osgm_sweep","dram__bytes.sum","byte","99"
"""


def test_table_sums_each_kernel_by_name():
    """Launches and device time per name, by time, in µs from any of ncu's units (thousands
    separators read), other metrics ignored; the sum and the call's wall time last."""
    lines = table(REPORT, 0.05).splitlines()
    assert lines[1].split() == ["osgm_sweep", "1", "20.0"]
    assert lines[2].split() == ["fusion_1", "2", "4.0"]
    assert lines[3].split()[-2:] == ["3", "24.0"]
    assert lines[4].split()[-1] == "50.0"


def test_decode_target_builds_the_decode_loop():
    """``decode --tiny``: the jitted loop of ``bench_decode_step`` and its arguments, which run
    (the steps of a small OSDN model on the CPU) to one greedy token."""
    import argparse

    import jax

    from benchmarks.ncu_kernels import build
    args = argparse.Namespace(target="decode", shape=(8, 2048, 8, 128), preset="deltanet-340m",
                              preconditioner="osgm", steps=2, tiny=True)
    fn, xs = build(args)
    token = jax.block_until_ready(fn(*xs))
    assert token.shape == (1,) and 0 <= int(token[0]) < 512
