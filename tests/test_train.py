"""The training system end to end: sharded steps on 8 fake devices, resume exactness, the NaN
stop, remat and gradient accumulation, configs and the CLI (tiny models, chunked ops, CPU)."""

import dataclasses
import io
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rich.console import Console

from precond_linattn.layers import BACKBONES, PRECONDITIONERS, LayerConfig, OSGMConfig
from precond_linattn.models import LanguageModel, ModelConfig, count_params
from train import loop
from train.__main__ import main
from train.build import data_spec, model_config
from train.checkpoint import Checkpointer
from train.config import (DataSpec, ExperimentConfig, LoggingConfig, ModelSpec, OptimConfig,
                          RunConfig, apply_overrides, load_runs)
from train.data import build_dataset, make_task
from train.metrics import NonFiniteLossError
from train.partitioning import annotate, param_axes
from train.step import device_batch, make_eval_step
from conftest import ROOT, run_python

QUIET = Console(file=io.StringIO())


def tiny(task="mqar", **changes) -> ExperimentConfig:
    """One DeltaNet layer of width 32, 2 heads; MQAR rows of 24 tokens or packed tiny_text rows."""
    params = (dict(vocab_size=64, num_kv_pairs=4) if task == "mqar"
              else dict(max_docs_per_row=4, max_doc_len=16, num_documents=200))
    cfg = ExperimentConfig(
        name="tiny",
        model=ModelSpec(kwargs=dict(num_layers=1, hidden_size=32, num_heads=2, impl="chunked", chunk_size=8)),
        data=DataSpec(task=task, params=params),
        optim=OptimConfig(peak_lr=1e-2, warmup_steps=1),
        logging=LoggingConfig(progress=False),
        run=RunConfig(steps=6, batch_size=4, seq_len=24, compute_dtype="float32"))
    return apply_overrides(cfg, [f"{k}={v}" for k, v in changes.items()])


@pytest.mark.heavy
def test_sharded_training_on_8_fake_devices():
    """(2, 2, 2) mesh: parameters sharded by the rules, no activation all-gather in the compiled
    step, losses equal to one device (tests/train_subprocess.py)."""
    run_python(ROOT / "tests" / "train_subprocess.py", timeout=300, ends_with="ok")


def test_resume_is_exact(tmp_path, monkeypatch):
    """Packed text rows: 6 steps in one go == 3 steps, stop (a checkpoint), resume, 3 more. The
    three runs' configs differ only in their checkpointing, so they share the first run's
    jitted step (one compilation instead of three: the suite's time); the parameters, optimiser
    state and data of each run are its own (built, or restored from the checkpoint)."""
    build, steps = loop.build, {}

    def shared_step_build(cfg, **kw):
        setup = build(cfg, **kw)
        key = repr(dataclasses.replace(cfg, checkpoint=type(cfg.checkpoint)()))
        setup.train_step = steps.setdefault(key, setup.train_step)
        return setup

    monkeypatch.setattr(loop, "build", shared_step_build)
    whole = loop.train(tiny("tiny_text"), console=QUIET)
    cfg = tiny("tiny_text", **{"checkpoint.dir": tmp_path, "checkpoint.every": 100})
    first = loop.train(cfg, stop_at=3, console=QUIET)
    assert first.stopped and sorted(first.losses) == [1, 2, 3]
    second = loop.train(cfg, console=QUIET)
    assert not second.stopped and sorted(second.losses) == [4, 5, 6]
    assert {**first.losses, **second.losses} == whole.losses
    assert len(set(whole.losses.values())) == 6
    assert len(steps) == 1  # the configs differ in checkpointing only


@pytest.mark.heavy
def test_remat_accumulation_and_scan_give_the_same_steps():
    """Two blocks: the per-block loop == remat with two accumulated micro-batches == the scan over
    the layers (with and without remat): the same three losses."""
    two = {"run.steps": 3, "model.kwargs.num_layers": 2}
    base = loop.train(tiny(**two), console=QUIET).losses
    for changes in ({"run.remat": True, "optim.grad_accum": 2}, {"run.scan_layers": True},
                    {"run.scan_layers": True, "run.remat": True}):
        other = loop.train(tiny(**two, **changes), console=QUIET).losses
        np.testing.assert_allclose([other[s] for s in (1, 2, 3)], [base[s] for s in (1, 2, 3)],
                                   rtol=1e-6, err_msg=str(changes))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    build_step = loop.make_train_step

    def poisoned(*args, **kwargs):
        step, calls = build_step(*args, **kwargs), itertools.count(1)

        def run(params, opt_state, batch):
            params, opt_state, metrics = step(params, opt_state, batch)
            return params, opt_state, dict(metrics, loss=jnp.nan) if next(calls) == 5 else metrics

        return run

    monkeypatch.setattr(loop, "make_train_step", poisoned)
    cfg = tiny(**{"checkpoint.dir": tmp_path, "checkpoint.every": 2, "checkpoint.keep": 5})
    with pytest.raises(NonFiniteLossError, match=r"non-finite \{'loss': nan\} at step 5: stopping the run"):
        loop.train(cfg, console=QUIET)
    with Checkpointer(cfg.checkpoint, handle_sigterm=False) as ck:
        assert ck.manager.all_steps() == [2, 4]  # step 6 was never reached, nothing saved after 4


def test_the_step_takes_the_states_as_leaf_lists():
    """train.step's states travel as lists (cheap to flatten on the host); trees() rebuilds the
    very trees, with the same arrays, that leaves() took apart."""
    setup = loop.build(tiny())
    param_leaves, opt_leaves = setup.shardings.leaves(setup.params, setup.opt_state)
    assert type(param_leaves) is list and type(opt_leaves) is list and len(opt_leaves) > len(param_leaves)
    params, opt_state = setup.shardings.trees(param_leaves, opt_leaves)
    for got, want in ((params, setup.params), (opt_state, setup.opt_state)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert all(a is b for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def test_evaluator_draws_once_and_sums_on_device(monkeypatch):
    """The held-out batches are drawn once for every evaluation; the device-side sums give the
    metrics of summing each batch's on the host (the former way), exactly."""
    cfg = tiny(**{"logging.eval_batches": 3})
    setup = loop.build(cfg)
    assert setup.task == make_task(setup.data) and setup.model_config.vocab_size == 64
    built = []
    monkeypatch.setattr(loop, "build_dataset", lambda *a, **k: built.append(a) or build_dataset(*a, **k))
    evaluate = loop.Evaluator(cfg, setup.graphdef, setup.shardings, setup.task)
    first, second = evaluate(setup.params), evaluate(setup.params)
    assert len(built) == 1 and first == second
    step, data, totals = make_eval_step(setup.graphdef, setup.shardings), iter(build_dataset(
        data_spec(cfg, evaluation=True))), None
    for _ in range(3):
        sums = jax.device_get(step(setup.params, device_batch(next(data), 1, setup.shardings.batch)))
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    n = float(totals["count"])
    assert n > 0 and first == dict(loss=float(totals["nll"]) / n, accuracy=float(totals["correct"]) / n)
    assert loop.train(tiny(**{"run.steps": 2}), console=QUIET).num_params == count_params(setup.model_config)


@pytest.mark.heavy
def test_main_job_prints_the_accuracy_table(tmp_path):
    """The README's command, shortened to a few steps of 8 rows (the suite's time): the table,
    then the PNG of the curves."""
    result = run_python("-m", "train", "--config", "configs/mqar_smoke.py", "run.steps=3",
                        "run.batch_size=8",
                        "optim.warmup_steps=1", "logging.eval_every=3", "logging.eval_batches=1",
                        "logging.progress=false", f"logging.dir={tmp_path}", "--plot",
                        str(tmp_path / "curves.png"), devices=None, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == f"loss curves: {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = result.stdout.strip().splitlines()[-5:-1]
    assert table[0].split() == ["run", "model", "params", "steps", "train", "loss", "eval", "accuracy"]
    names = [row.split()[:2] for row in table[2:]]
    assert names == [["mqar_smoke/DeltaNet", "DeltaNet"], ["mqar_smoke/OSDN", "OSDN"]]
    assert all(0 <= float(row.split()[-1]) <= 1 for row in table[2:])
    assert (tmp_path / "OSDN" / "metrics.jsonl").read_text().count("eval/accuracy") == 1


def test_cli_errors(capsys):
    assert main(["--config", "configs/mqar_smoke.py", "optim.peak_rl=1"]) == 2
    assert "unknown config key 'optim.peak_rl'. Did you mean 'optim.peak_lr'?" in capsys.readouterr().err
    assert main(["--config", "configs/mqar_smoke.py", "--only", "nope"]) == 2
    assert "no variant of configs/mqar_smoke.py matches ['nope']" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown model.kwargs \['num_layer'\]"):
        model_config(tiny(**{"model.kwargs.num_layer": 2}), 64)
    with pytest.raises(ValueError, match="differs from run.seq_len"):
        data_spec(tiny(**{"data.params.seq_len": 32}))


def test_config_files():
    """Every config builds its data spec and model; the sweeps have their variants."""
    expected = {"mqar_smoke": 2, "mqar_sweep": 36, "osdn_340m": 1, "pdn_340m": 1, "osdn_1.3b": 1, "pdn_1b": 1}
    for name, count in expected.items():
        runs = load_runs(ROOT / "configs" / f"{name}.py")
        assert len(runs) == count
        for cfg in runs.values():  # the text configs' tokenizer file is not here: 32,000 ids
            task = make_task(data_spec(cfg))
            model_config(cfg, task.vocab_size if cfg.data.task == "mqar" else 32000)
    sweep = load_runs(ROOT / "configs" / "mqar_sweep.py", ["run.steps=1000"], only=["len64/PGDN/*"])
    assert list(sweep) == [f"mqar_sweep/len64/PGDN/T{T}" for T in (256, 512, 1024, 2048)]
    cfg = sweep["mqar_sweep/len64/PGDN/T1024"]
    assert (cfg.run.seq_len, cfg.data.params["num_kv_pairs"], cfg.run.steps) == (1024, 64, 1000)
    assert model_config(cfg, 8192).layer.variant == "PGDN"
    pdn = load_runs(ROOT / "configs" / "pdn_340m.py", ["model.kwargs.preconditioner=none"])["pdn_340m"]
    assert model_config(pdn, 32000).layer.variant == "DeltaNet"
    assert model_config(pdn, 32000).layer.dtype == jnp.bfloat16


@pytest.mark.parametrize("backbone", BACKBONES)
def test_every_parameter_has_logical_axes(backbone):
    """All twelve variants with every optional parameter, tied or not."""
    for pre in PRECONDITIONERS:
        osgm = OSGMConfig(learn_init_scale=True) if pre.startswith("osgm") else None
        layer = LayerConfig(32, 2, backbone=backbone, preconditioner=pre, osgm=osgm, conv_bias=True,
                            use_gate=True)
        for tie in (False, True):
            config = ModelConfig(vocab_size=64, num_layers=1, layer=layer, tie_embeddings=tie)
            model = nnx.eval_shape(lambda: annotate(LanguageModel(config, rngs=nnx.Rngs(0))))
            params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
            assert params and all(v.get_metadata().get("out_sharding") for v in params)
    assert param_axes("layers/3/attn/f_proj/layers/1/kernel", 2) == (None, "heads")
    with pytest.raises(ValueError, match="matches no rule"):
        param_axes("layers/0/attn/new_thing", 1)
