"""sass_read's first step on the CPU: every WY kernel lowers for CUDA to one Triton module,
written with its launch for the second step (which needs pip's triton, not in this venv)."""

import json
import sys

import pytest

from benchmarks import sass_read


def test_lower_writes_each_kernel_and_its_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["sass_read.py", "lower", str(tmp_path)])
    sass_read.main()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta == {"wy_fwd": dict(num_warps=4, num_stages=2),
                    "wy_bwd": dict(num_warps=8, num_stages=2),
                    "wy_vector_fwd": dict(num_warps=8, num_stages=2),
                    "wy_vector_bwd": dict(num_warps=8, num_stages=2)}
    for name in meta:
        text = (tmp_path / f"{name}.ttir").read_text()
        assert text.count("tt.func") >= 1 and "tt.dot" in text, name


def test_unknown_kernel_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["sass_read.py", "lower", str(tmp_path), "--kernels",
                                      "wy_fwd,delta_fwd"])
    with pytest.raises(SystemExit):
        sass_read.main()


def test_sass_counts_reads_opcodes():
    listing = """
        /*0010*/                   STL [R1+0x4], R2 ;
        /*0020*/              @!P0 LDL R3, [R1+0x4] ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/                   STL.64 [R1+0x8], R6 ;
    """
    assert sass_read.sass_counts(listing) == {"STL": 2, "LDL": 1, "HMMA": 1}
