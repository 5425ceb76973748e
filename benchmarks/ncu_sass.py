"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's source page of one
kernel as SASS with its warp-state samples (RESULTS run 178: which loop holds the time, how
many iterations a warp runs it, and on what its instructions stall). On the device:

    ncu --profile-from-start off --clock-control none --kernel-name regex:"osgm_fwd_mosaic" \\
        --launch-count 1 --section SourceCounters --section WarpStateStats -o report \\
        python benchmarks/ncu_kernels.py osgm --grad --inner
    ncu -i report.ncu-rep --page source --csv --print-source sass > fwd.csv
    python benchmarks/ncu_sass.py fwd.csv [--top 30] [--ctas-warps 256]

Loops are the backward branches (a ``BRA`` to an address at or before its own): for each, its
share of the samples, its length in instructions, and how many times a warp ran its first
instruction (executions / ``--ctas-warps``, the warps that run it: CTAs x warps of the
warpgroup). Samples are per warp, so a loop's share is of all warps' time; a warpgroup's
share of the kernel is its warps' share. Then the ``--top`` instructions by samples, each with
its three largest stall reasons (ncu's ``stall_*`` columns).
"""

import argparse
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path):
    """(kernel name, rows as dicts) of a source-page CSV of one kernel."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or rows[0][:1] != ["Kernel Name"] or SAMPLES not in rows[1]:
        raise ValueError(f"{path!r} is not ncu's --page source --csv --print-source sass output "
                         "of one kernel")
    header = rows[1]
    return rows[0][1], [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def _int(x):
    return int(x) if x.strip() else 0


def loops(rows):
    """(first address, last address) of each backward branch's loop, in program order."""
    found = []
    for r in rows:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-fA-F]+)", r["Source"])
        if m and int(m.group(1), 16) <= int(r["Address"], 16):
            found.append((int(m.group(1), 16), int(r["Address"], 16)))
    return found


def stalls(row, n=3):
    """The ``n`` largest stall reasons of an instruction, (samples, reason)."""
    reasons = [(_int(v), k[len("stall_"):]) for k, v in row.items()
               if k.startswith("stall_") and "Not Issued" not in k]
    return sorted(reasons, reverse=True)[:n]


def report(rows, top=30, warps=1):
    """Lines: the loops, then the ``top`` instructions by samples."""
    total = sum(_int(r[SAMPLES]) for r in rows) or 1
    addr = [int(r["Address"], 16) for r in rows]
    lines = [f"{total} samples, {len(rows)} instructions",
             f"{'loop':>23s} {'samples %':>9s} {'length':>6s} {'runs a warp':>11s}"]
    for a, b in loops(rows):
        inside = [r for r, x in zip(rows, addr) if a <= x <= b]
        share = 100 * sum(_int(r[SAMPLES]) for r in inside) / total
        lines.append(f"{f'{a & 0xffffff:#x}-{b & 0xffffff:#x}':>23s} {share:9.1f} {len(inside):6d} "
                     f"{_int(inside[0][EXECUTED]) / warps:11.1f}")
    lines.append(f"{'address':>10s} {'%':>5s} {'executed':>9s}  instruction  [stalls]")
    for r in sorted(rows, key=lambda r: -_int(r[SAMPLES]))[:top]:
        lines.append(f"{int(r['Address'], 16) & 0xffffff:#10x} "
                     f"{100 * _int(r[SAMPLES]) / total:5.1f} {_int(r[EXECUTED]):9d}  "
                     f"{r['Source'].strip()[:56]:56s} {stalls(r)}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--ctas-warps", type=int, default=1,
                    help="warps that run the loops (CTAs x warps of the warpgroup)")
    a = ap.parse_args(argv)
    name, rows = read(a.csv)
    print(name)
    print("\n".join(report(rows, a.top, a.ctas_warps)))


if __name__ == "__main__":
    main()
