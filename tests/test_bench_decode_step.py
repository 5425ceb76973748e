"""bench_decode_step at a tiny model on the CPU (the fused kernel in interpret mode): the rows it
prints, one set per launch, and their ratios to the host backbone of the same launch."""

import argparse
import json
import sys

import pytest

from benchmarks import bench_decode_step


def test_tiny_run_prints_rows_and_ratios(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_decode_step.py", "--tiny", "--steps", "2",
                                      "--preconditioners", "none", "osgm", "--fused", "on",
                                      "--launch", "16/1", "64/2"])
    bench_decode_step.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(x) for x in lines if x.startswith("{")]
    assert [(r["preconditioner"], r["fused"]) for r in rows] == [
        ("none", "on 16/1"), ("osgm", "on 16/1"), ("none", "on 64/2"), ("osgm", "on 64/2")]
    assert all(r["step_us"] > 0 for r in rows)
    table = [x.split() for x in lines[-4:]]
    assert [t[-1] for t in table[::2]] == ["1.000", "1.000"]
    for i in (0, 2):
        ratio = rows[i + 1]["step_us"] / rows[i]["step_us"]
        assert abs(float(table[i + 1][-1]) - ratio) < 1e-3


def test_bad_launch_text_is_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="BV/W"):
        bench_decode_step.launch("32x4")
