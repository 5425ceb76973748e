"""benchmarks/ncu_stalls.py reads an Nsight Compute ``--csv --page raw`` report."""

import pytest

from benchmarks.ncu_stalls import describe, kernels, stalls

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEADER = ["ID", "Kernel Name", "launch__registers_per_thread", STALL.format("barrier"),
          STALL.format("no_instruction"), STALL.format("wait"),
          "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sector_hit_rate.pct"]
REPORT = [
    "wall_ms 0.359",  # the profiled program's own output comes first
    "==PROF== Connected to process 599",
    ",".join(f'"{h}"' for h in HEADER),
    '"","","register/thread","ratio","ratio","ratio","%","%"',
    '"0","wy_inverse_mosaic","255","1.71","0.05","0.98","61.2","48.5"',
    '"1","state_fwd_wy_mosaic","203","1,360.5","","0.65","84.9","51.0"',
]


def test_reads_kernels_and_orders_their_stalls():
    found = kernels(REPORT)
    assert [k["Kernel Name"] for k in found] == ["wy_inverse_mosaic", "state_fwd_wy_mosaic"]
    assert stalls(found[0], 2) == [("barrier", 1.71), ("wait", 0.98)]
    assert stalls(found[1], 5) == [("barrier", 1360.5), ("wait", 0.65)]  # empty cells skipped
    text = describe(found[0])
    assert text.splitlines()[0] == "wy_inverse_mosaic" and "regs=255" in text
    assert "dram %=61.2" in text and "L2 hit %=48.5" in text
    assert "stalls: barrier 1.71, wait 0.98, no_instruction 0.05" in text


def test_a_report_without_a_table_is_refused():
    with pytest.raises(ValueError, match="no ncu table"):
        kernels(["==ERROR== The application returned an error code (11)."])
