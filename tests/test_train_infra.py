"""The training system's infrastructure: configs, optimiser, sharding, checkpoints, metrics."""

import dataclasses
import io
import json
import math
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from rich.console import Console

from precond_linattn.models import LanguageModel, preset

from train.checkpoint import CheckpointError, Checkpointer
from train.config import (CheckpointConfig, ExperimentConfig, LoggingConfig, OptimConfig, apply_overrides,
                          load_config)
from train.metrics import Monitor, NonFiniteLossError, peak_flops
from train.optim import lr_schedule, make_optimizer, osdn_recipe, pdn_recipe, weight_decay_mask
from train.partitioning import annotate
from train.sharding import init_sharded, logical_to_spec, make_mesh
from conftest import ROOT, run_python

SCRIPT = ROOT / "tests" / "train_infra_subprocess.py"


# ---- config ----

def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "exp.py"
    path.write_text("from train.config import ExperimentConfig, ModelSpec, OptimConfig, RunConfig\n"
                    "def get_config():\n"
                    "    return ExperimentConfig(name='t', model=ModelSpec('deltanet-340m'),\n"
                    "        run=RunConfig(steps=50), optim=OptimConfig(warmup_steps=5))\n")
    cfg = load_config(path, ["optim.peak_lr=3e-4", "mesh.fsdp=4", "run.remat=true", "run.batch_size=1e1",
                             "optim.no_decay=bias,norm", "model.kwargs.preconditioner=osgm",
                             "model.kwargs.num_layers=2", "data.params.num_kv_pairs=8", "checkpoint.dir=/x"])
    assert cfg.optim.peak_lr == 3e-4 and cfg.mesh.fsdp == 4 and cfg.run.remat is True
    assert cfg.run.batch_size == 10
    assert cfg.optim.no_decay == ("bias", "norm")
    assert cfg.model.preset == "deltanet-340m"
    assert cfg.model.kwargs == {"preconditioner": "osgm", "num_layers": 2}
    assert cfg.data.params == {"num_kv_pairs": 8} and cfg.checkpoint.dir == "/x"
    assert cfg.optim.total_steps is None and cfg.optim.warmup_steps == 5
    assert apply_overrides(cfg, ["optim.total_steps=40"]).optim.total_steps == 40
    # Validated once at the end: the order of interdependent overrides does not matter.
    cfg = apply_overrides(ExperimentConfig(), ["run.steps=20", "optim.warmup_steps=2", "optim.min_lr=0"])
    assert (cfg.run.steps, cfg.optim.warmup_steps, cfg.optim.min_lr) == (20, 2, 0.0)


def test_config_errors(tmp_path):
    cfg = ExperimentConfig()
    with pytest.raises(ValueError, match=r"key 'optim.peak_rl'. Did you mean 'optim.peak_lr'.*run.seed"):
        apply_overrides(cfg, ["optim.peak_rl=1"])
    for key in ("run", "run.steps.x", "model.kwargs", "model.kwargs.a.b", "nope"):
        with pytest.raises(ValueError, match=f"unknown config key '{key}'"):
            apply_overrides(cfg, [f"{key}=3"])
    with pytest.raises(ValueError, match="run.steps: expected int, got '1.5'"):
        apply_overrides(cfg, ["run.steps=1.5"])
    with pytest.raises(ValueError, match="expected a bool"):
        apply_overrides(cfg, ["run.remat=maybe"])
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(cfg, ["run.steps"])
    with pytest.raises(ValueError, match=r"optim.warmup_steps \(5000\) must be < the schedule's 1000 steps"):
        apply_overrides(cfg, ["optim.warmup_steps=5000"])
    with pytest.raises(ValueError, match="multiple of optim.grad_accum"):
        apply_overrides(cfg, ["optim.grad_accum=3"])
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_config(tmp_path / "nope.py")


# ---- optimiser ----

def test_schedule_values():
    cfg = OptimConfig(peak_lr=1e-3, min_lr=1e-4, warmup_steps=100, total_steps=1000)
    lr = lr_schedule(cfg)
    assert float(lr(0)) == 0.0
    np.testing.assert_allclose([lr(50), lr(100), lr(550), lr(1000)], [5e-4, 1e-3, 5.5e-4, 1e-4], rtol=1e-6)
    pdn = pdn_recipe(28610, tokens_per_step=524288)
    assert (pdn.peak_lr, pdn.min_lr, pdn.weight_decay, pdn.grad_clip) == (4e-4, 4e-5, 0.01, 1.0)
    assert pdn.warmup_steps == 954  # 0.5B tokens
    osdn = osdn_recipe()
    assert (osdn.peak_lr, osdn.grad_clip, osdn.total_steps) == (1e-3, 1.0, 20480)


def test_weight_decay_mask_and_accumulation():
    params = {"embeddings": {"embedding": jnp.ones((8, 4))},
              "attn": {"q_proj": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}, "A_log": jnp.ones(2),
                       "dt_bias": jnp.ones(2), "retention_proj": {"kernel": jnp.ones((4, 2))},
                       "q_conv1d": {"kernel": jnp.ones((4, 4))}, "o_norm": {"scale": jnp.ones(2)}},
              "lm_head": {"kernel": jnp.ones((4, 8))}}
    mask = weight_decay_mask(params)
    assert mask == {"embeddings": {"embedding": True},
                    "attn": {"q_proj": {"kernel": True, "bias": False}, "A_log": False, "dt_bias": False,
                             "retention_proj": {"kernel": False}, "q_conv1d": {"kernel": True},
                             "o_norm": {"scale": False}},
                    "lm_head": {"kernel": True}}
    assert weight_decay_mask(params, ("embed",))["embeddings"]["embedding"] is False

    # Zero gradients: only weight decay moves parameters, and only the masked ones.
    tx = make_optimizer(OptimConfig(warmup_steps=0, weight_decay=0.5), total_steps=10)
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, state = tx.update(zeros, state, params)
    moved = jax.tree.map(lambda u: bool(jnp.abs(u).max() > 0), updates)
    assert moved == mask


# ---- sharding ----

def test_logical_rules():
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "fsdp"), None, None)
    assert logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert logical_to_spec(("batch", "seq", "heads", "kv")) == P(("data", "fsdp"), None, "tensor", None)
    assert logical_to_spec(("unknown", None)) == P(None, None)
    with pytest.raises(ValueError, match=r"needs 8 devices, but there are 1"):
        make_mesh(2, 2, 2, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="-1 for at most one"):
        make_mesh(-1, -1, 1)
    assert dict(make_mesh(1, -1, 1, devices=jax.devices()[:1]).shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_sharding_on_8_fake_devices(tmp_path):
    """Params sharded as the rules say on a (2, 2, 2) mesh; a train step matches one device;
    a sharded checkpoint restores with its shardings."""
    run_python(SCRIPT, "sharding", tmp_path / "ckpt", timeout=120, ends_with="ok")



def test_init_sharded_compiles_each_initialiser_once():
    """``init_sharded`` runs identical layers through the same compiled initialisers: after a
    1-layer model, a 4-layer one of the same shapes compiles nothing (one jit of the whole
    constructor compiled an RNG subgraph per parameter: minutes for 24 layers), and the values
    are those of building the model eagerly."""
    config = dataclasses.replace(preset("kda-340m-pdn", "osgm_apf", hidden_size=64, num_heads=2),
                                 vocab_size=128, tie_embeddings=False)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])

    def make(num_layers):
        return lambda: annotate(LanguageModel(dataclasses.replace(config, num_layers=num_layers),
                                              rngs=nnx.Rngs(0)))

    init_sharded(make(1), mesh)
    compiles = []
    listener = lambda event, duration, **kwargs: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        model = init_sharded(make(4), mesh)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert "/jax/core/compile/backend_compile_duration" not in compiles
    with nnx.use_eager_sharding(False):
        eager = make(4)()
    assert _equal(nnx.state(model), nnx.state(eager))


# ---- checkpoints ----

def _state(seed):
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    opt.update(model, grads)
    return nnx.state(model), nnx.state(opt)


def _equal(a, b):
    return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b))


def test_checkpoint_round_trip_and_keep(tmp_path):
    cfg = CheckpointConfig(dir=str(tmp_path), every=2, keep=2)
    with Checkpointer(cfg) as ck:
        assert [ck.should_save(s) for s in (1, 2, 3)] == [False, True, False] and ck.should_save(3, last=True)
        for step in (2, 4, 6):
            model, opt = _state(step)
            data_state = {"next_index": step} if step != 6 else b'{"next_index": 6}'
            ck.save(step, model=model, opt=opt, rng=jax.random.key(step), data_state=data_state)
        ck.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "6"]  # keep the last 2

    target_model, target_opt = _state(0)
    with Checkpointer(cfg) as ck:
        r = ck.restore(model=target_model, opt=target_opt)
        assert r.step == 6 and r.data_state == b'{"next_index": 6}'
        assert _equal(r.model, _state(6)[0]) and _equal(r.opt, _state(6)[1])
        assert np.array_equal(jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(6)))
        r4 = ck.restore(4, model=target_model, opt=target_opt)
        assert r4.data_state == {"next_index": 4} and _equal(r4.model, _state(4)[0])
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 2 .* steps: \[4, 6\]"):
            ck.restore(2, model=target_model, opt=target_opt)
        # A raw uint32 key comes back as it was.
        ck.save(7, model=target_model, opt=target_opt, rng=jax.random.PRNGKey(3))
        ck.wait()
        assert np.array_equal(ck.restore(model=target_model, opt=target_opt).rng, jax.random.PRNGKey(3))


def test_checkpoint_missing_and_corrupt(tmp_path):
    model, opt = _state(0)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "empty"))) as ck:
        with pytest.raises(CheckpointError, match="no checkpoint to restore in .*empty"):
            ck.restore(model=model, opt=opt)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"))) as ck:
        ck.save(1, model=model, opt=opt, rng=jax.random.key(0))
    meta = next((tmp_path / "c" / "1" / "meta").iterdir())
    meta.write_text("{not json")
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"))) as ck:
        with pytest.raises(CheckpointError, match=r"checkpoint .*c/1 is corrupt .*JSONDecodeError"):
            ck.restore(model=model, opt=opt)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"))) as ck:  # wrong structure
        with pytest.raises(CheckpointError, match=r"checkpoint .*c/1 is corrupt or does not match"):
            ck.restore(model={"w": jnp.ones(2)}, opt=opt)


def test_failed_save_keeps_previous(tmp_path, monkeypatch):
    """Step 2's items are all written, then its final rename (the commit) fails."""
    from orbax.checkpoint._src.path import async_path

    rename = async_path.rename

    async def failing_rename(src, dst):
        if Path(dst).name == "2":
            raise OSError("injected failure committing step 2")
        return await rename(src, dst)

    cfg = CheckpointConfig(dir=str(tmp_path), every=1, keep=1)
    model, opt = _state(1)
    with Checkpointer(cfg) as ck:
        ck.save(1, model=model, opt=opt, rng=jax.random.key(1), data_state={"i": 1})
        ck.wait()
        monkeypatch.setattr(async_path, "rename", failing_rename)
        with pytest.raises(OSError, match="injected failure"):
            ck.save(2, model=_state(2)[0], opt=_state(2)[1], rng=jax.random.key(2), data_state={"i": 2})
            ck.wait()
        monkeypatch.undo()
    assert (tmp_path / "2.orbax-checkpoint-tmp").is_dir() and not (tmp_path / "2").exists()
    with Checkpointer(cfg) as ck:
        assert ck.latest_step() == 1
        r = ck.restore(model=model, opt=opt)
        assert r.step == 1 and r.data_state == {"i": 1} and _equal(r.model, model) and _equal(r.opt, opt)


def test_sigterm_saves_and_exits(tmp_path):
    result = run_python(SCRIPT, "sigterm", tmp_path, timeout=120)
    assert "stopped at 3" in result.stdout, result.stdout[-1000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]
    previous = signal.getsignal(signal.SIGTERM)
    with Checkpointer(CheckpointConfig(dir=str(tmp_path))) as ck:
        assert signal.getsignal(signal.SIGTERM) == ck._on_sigterm
    assert signal.getsignal(signal.SIGTERM) == previous


# ---- metrics ----

def test_metrics_files_and_nan_check(tmp_path):
    monitor = Monitor(LoggingConfig(dir=str(tmp_path), every=2), total_steps=10, tokens_per_step=1000,
                      flops_per_token=6e6, console=Console(file=io.StringIO()))
    written = [monitor.update(step, {"loss": np.float32(2 / step), "grad_norm": jnp.float32(1), "lr": 1e-3})
               for step in range(1, 5)]
    monitor.write_eval(4, {"accuracy": 0.5})
    with pytest.raises(NonFiniteLossError, match="non-finite .*'loss': nan.* at step 5"):
        monitor.update(5, {"loss": math.nan})
    with pytest.raises(NonFiniteLossError, match=r"non-finite \{'grad_norm': inf\} at step 5"):
        monitor.update(5, {"loss": 1.0, "grad_norm": math.inf})
    monitor.close()
    assert written[0] is None and written[2] is None and written[1]["tokens_per_s"] > 0
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in lines] == [2, 4, 4] and lines[1]["loss"] == 0.5
    assert lines[2] == {"step": 4, "eval/accuracy": 0.5}
    assert "mfu" not in lines[1]  # CPU: peak unknown
    assert set(lines[1]) >= {"loss", "grad_norm", "lr", "tokens_per_s", "step_time"}
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("cpu") is None


def test_mfu(monkeypatch):
    monkeypatch.setattr("train.metrics.peak_flops", lambda kind: 1e9)
    monitor = Monitor(LoggingConfig(every=1, progress=False), total_steps=3, tokens_per_step=100,
                      flops_per_token=1e6)
    monitor.update(1, {"loss": 1.0})
    m = monitor.update(2, {"loss": 1.0})
    np.testing.assert_allclose(m["mfu"], m["tokens_per_s"] * 1e6 / (1e9 * jax.device_count()), rtol=1e-12)
