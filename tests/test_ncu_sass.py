"""benchmarks/ncu_sass.py: the loops and hottest instructions of ncu's SASS source page."""

import csv

import pytest

from benchmarks import ncu_sass

HEADER = ["Address", "Source", ncu_sass.SAMPLES, ncu_sass.EXECUTED, "stall_wait", "stall_long_sb",
          "stall_wait (Not Issued)"]


def write(path, rows, name="k_mosaic_gpu_kernel"):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", name])
        w.writerow(HEADER)
        w.writerows(rows)


def test_loops_and_hot_instructions(tmp_path):
    """A loop of three instructions (its branch back to 0x10) run 8 times by each of 2 warps
    holds 60 of 100 samples; the hottest instruction comes first with its stall reasons, the
    "Not Issued" columns left out."""
    rows = [["0x00", "MOV R1, R2", "10", "2", "1", "0", "99"],
            ["0x10", "FFMA R1, R1, R2, R3", "40", "16", "30", "2", "0"],
            ["0x20", "FMNMX R1, R1, 2, PT", "15", "16", "10", "0", "0"],
            ["0x30", "@P1 BRA 0x10", "5", "16", "0", "5", "0"],
            ["0x40", "@!P1 BRA 0x50", "30", "2", "0", "30", "0"],
            ["0x50", "EXIT", "", "2", "", "", ""]]
    write(tmp_path / "k.csv", rows)
    name, parsed = ncu_sass.read(str(tmp_path / "k.csv"))
    assert name == "k_mosaic_gpu_kernel" and ncu_sass.loops(parsed) == [(0x10, 0x30)]
    lines = ncu_sass.report(parsed, top=2, warps=2)
    assert lines[0] == "100 samples, 6 instructions"
    assert lines[2].split() == ["0x10-0x30", "60.0", "3", "8.0"]
    assert lines[4].split()[:3] == ["0x10", "40.0", "16"]
    assert "(30, 'wait'), (2, 'long_sb')" in lines[4] and "99" not in lines[4]
    assert lines[5].split()[:2] == ["0x40", "30.0"]


def test_other_files_raise(tmp_path):
    (tmp_path / "raw.csv").write_text('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(ValueError, match="not ncu's --page source"):
        ncu_sass.read(str(tmp_path / "raw.csv"))
