"""Launch shape, occupancy, issue rate and the top warp stalls of each kernel in an Nsight
Compute report printed as CSV (``--csv --page raw``): the table of RESULTS runs 146 and
150-151, where "no instruction" (instruction-cache misses) or barrier / scoreboard waits say
what bounds a Mosaic kernel before its registers do, and the DRAM columns (bytes, share of
the peak bandwidth, L2 hit rate) whether its bytes do (NOTES, session 32: the forward state
pass reads 64 KB a CTA-chunk against jla's 48). On the device:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --profile-from-start off --clock-control none \\
        --kernel-name regex:"wy_inverse|state_fwd_wy" --launch-count 2 \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --csv --page raw \\
        python benchmarks/ncu_kernels.py delta --core deltanet --inner > report.csv
    python benchmarks/ncu_stalls.py report.csv

(JAX's preallocation makes ncu's replays fail with CUDA_ERROR_OUT_OF_MEMORY.) Stalls are ncu's
``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``: cycles a warp spends in
that state per instruction issued.
"""

import argparse
import csv

SHOWN = {  # column: its label in the table
    "gpu__time_duration.sum": "ns",
    "launch__registers_per_thread": "regs",
    "launch__shared_mem_per_block_dynamic": "smem B",
    "launch__grid_size": "CTAs",
    "launch__block_size": "threads",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "warps active %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue active %",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "dram__bytes_read.sum": "dram read",
    "dram__bytes_write.sum": "dram written",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
}
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def kernels(lines):
    """[{column: value}] for each profiled kernel of a ``--csv --page raw`` report (the lines
    before its header, such as the program's own output, skipped; the units row too)."""
    rows = list(csv.reader(lines))
    start = next((i for i, r in enumerate(rows) if r[:1] == ["ID"]), None)
    if start is None:
        raise ValueError("no ncu table (a header row starting with 'ID') in the report")
    header = rows[start]
    return [dict(zip(header, r)) for r in rows[start + 2:] if len(r) == len(header)]


def number(text):
    """ncu's number text ("1,234.5") as a float."""
    return float(text.replace(",", ""))


def stalls(kernel, top):
    """The ``top`` largest stall reasons of a kernel: [(reason, cycles an instruction)]."""
    found = [(name[len(STALL[0]):-len(STALL[1])], number(value)) for name, value in kernel.items()
             if name.startswith(STALL[0]) and name.endswith(STALL[1]) and value]
    return sorted(found, key=lambda pair: -pair[1])[:top]


def describe(kernel, top=5):
    """One kernel as two lines: its name and shown columns, then its top stalls."""
    shown = "  ".join(f"{label}={kernel[name]}" for name, label in SHOWN.items() if name in kernel)
    waits = ", ".join(f"{reason} {cycles:.2f}" for reason, cycles in stalls(kernel, top))
    return f"{kernel.get('Kernel Name', '?')}\n    {shown}\n    stalls: {waits}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="ncu's --csv --page raw output")
    p.add_argument("--top", type=int, default=5, help="stall reasons shown a kernel")
    a = p.parse_args()
    with open(a.report, newline="") as f:
        for kernel in kernels(f):
            print(describe(kernel, a.top))


if __name__ == "__main__":
    main()
