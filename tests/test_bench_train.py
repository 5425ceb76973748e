"""benchmarks/bench_train.py (issue 7's multi-device run): the same global batches on any mesh,
loss parity of data-parallel and FSDP runs with one device at the same global batch, the table's
rows and the option checks."""

import importlib.util
import json

import numpy as np
import pytest

from conftest import ROOT, run_python

SCRIPT = ROOT / "benchmarks" / "bench_train.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_random_rows_depend_on_seed_step_and_row_only():
    random_rows = load_bench().random_rows
    whole = random_rows(3, 5, 0, 6, 512, 17)
    assert whole.shape == (6, 18) and whole.dtype == np.int32
    assert whole.min() >= 0 and whole.max() < 512 and len(np.unique(whole)) > 80
    np.testing.assert_array_equal(random_rows(3, 5, 2, 3, 512, 17), whole[2:5])
    assert not np.array_equal(random_rows(3, 6, 0, 6, 512, 17), whole)
    assert not np.array_equal(random_rows(4, 5, 0, 6, 512, 17), whole)


def test_layers_and_impl_override_the_preset():
    """``--layers`` / ``--impl`` (the memory probe's few-block steps) after ``--tiny``'s shape."""
    model_config = load_bench().model_config
    config = model_config("deltanet-340m", "osgm", "bfloat16", False, True, layers=1, impl="chunked")
    assert config.num_layers == 1 and config.layer.impl == "chunked"
    assert config.layer.hidden_size == 128
    default = model_config("deltanet-340m", "none", "bfloat16", False, False)
    assert default.num_layers == 24 and default.layer.impl == "auto"


@pytest.mark.parametrize("argv, message", [
    (["--losses", "6", "--steps", "3"], "--losses 6"),
    (["--compare-mesh", "1", "1", "1"], "--compare-mesh needs --losses"),
    (["--mesh", "1000", "1", "1"], "--mesh 1000 1 1"),
    (["--mesh", "0", "1", "1"], "--mesh 0 1 1"),
    (["--batch", "0"], "--batch"),
    (["--layers", "0"], "--layers"),
    (["--impl", "cuda"], "--impl"),
    (["--atk-stream", "0"], "--atk-stream 0"),
])
def test_bad_options_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_bench().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.heavy
def test_data_parallel_and_fsdp_match_one_device_at_the_same_global_batch():
    """float32 compute with the full learning rate from step 1 on: the losses of the first 3
    steps (two real updates) on the mesh (data 2, fsdp 2) equal one device's with the same 8-row
    global batch as 4 micro-batches, up to float rounding. One block (``--layers 1``: the
    parity is per block; the suite's time)."""
    out = run_python(SCRIPT, "--tiny", "--layers", "1", "--preconditioners", "osgm",
                     "--seq-len", "64", "--batch", "2",
                     "--mesh", "2", "2", "1", "--compare-mesh", "1", "1", "1",
                     "--losses", "3", "--steps", "1", "--compare-steps", "1", "--lr-warmup", "1",
                     "--compute-dtype", "float32", timeout=300).stdout
    rows = [(line[21:39].strip(), *line[39:].split()) for line in out.splitlines()
            if line.startswith("deltanet-340m/osgm ")]
    assert [(r[0], r[1]) for r in rows] == [("mesh 2,2,1", "2x1"), ("weak 1,1,1", "2x1"),
                                            ("parity 1,1,1 B8", "2x4")]
    assert all(len(r) == 12 for r in rows) and float(rows[0][-1]) <= 1e-5  # max|dloss| column
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    losses = summary["losses"]
    assert all(len(v) == 3 for v in losses.values()) and len(set(losses["parity 1,1,1 B8"])) == 3
    assert summary["max_rel_loss_diff"]["mesh 2,2,1"] <= 1e-6, losses
    assert summary["weak_scaling"]["mesh 2,2,1"] > 0
    assert losses["weak 1,1,1"][0] != losses["parity 1,1,1 B8"][0]  # 2 rows, not the 8-row batch


@pytest.mark.heavy
def test_packed_rows_train_like_dense_rows():
    """``--packed`` (each row one document: the ops vmapped over [1, T] rows with cu_seqlens)
    gives the dense rows' losses over three float32 steps, two of them real updates; one block
    (``--layers 1``: the suite's time)."""
    def losses(*flags):
        out = run_python(SCRIPT, "--tiny", "--layers", "1", "--preconditioners", "osgm", "--seq-len", "64",
                         "--batch", "2", "--losses", "3", "--steps", "1", "--lr-warmup", "1",
                         "--compute-dtype", "float32", *flags, timeout=300).stdout
        summary = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        assert summary["packed"]["mesh 1,1,1"] == bool(flags)  # the step saw cu_seqlens or not
        return summary["losses"]["mesh 1,1,1"]

    dense, packed = losses(), losses("--packed")
    assert len(set(dense)) == 3
    np.testing.assert_allclose(packed, dense, rtol=1e-6)


def test_ratio_lines_compare_each_model_with_the_first():
    """The closing lines: tokens/s as a ratio of the first model's, XLA GiB as a difference."""
    runs = {"m/none": dict(tok_s=144243.0, xla_gib=28.78), "m/osgm": dict(tok_s=140643.0, xla_gib=29.63),
            "m/atk": dict(tok_s=132009.0, xla_gib=29.62)}
    assert load_bench().ratio_lines(runs, "mesh 1,1,1") == [
        "m/osgm / m/none (mesh 1,1,1): tokens/s 0.975x, XLA GiB +0.85",
        "m/atk / m/none (mesh 1,1,1): tokens/s 0.915x, XLA GiB +0.84"]
    assert load_bench().ratio_lines({"m/none": runs["m/none"]}, "mesh 1,1,1") == []
