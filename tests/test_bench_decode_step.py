"""bench_decode_step at a tiny model on the CPU (the fused kernel in interpret mode): the rows it
prints and their ratios to the host backbone."""

import json
import sys

from benchmarks import bench_decode_step


def test_tiny_run_prints_rows_and_ratios(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_decode_step.py", "--tiny", "--steps", "2",
                                      "--preconditioners", "none", "osgm", "--fused", "on"])
    bench_decode_step.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(x) for x in lines if x.startswith("{")]
    assert [(r["preconditioner"], r["fused"]) for r in rows] == [("none", "on"), ("osgm", "on")]
    assert all(r["step_us"] > 0 for r in rows)
    table = {x.split()[0]: x.split() for x in lines[-2:]}
    assert table["none"][-1] == "1.000"
    ratio = rows[1]["step_us"] / rows[0]["step_us"]
    assert abs(float(table["osgm"][-1]) - ratio) < 1e-3
