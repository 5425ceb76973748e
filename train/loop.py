"""One training run: mesh, model, optimiser and data from a config; resume; train; evaluate; save.

``train(cfg)`` builds the (data, fsdp, tensor) mesh, the model with its parameters sharded by
``train.partitioning`` (created directly in their shards), the optimiser state alike, the data
task (once: it sizes the vocabulary and feeds both pipelines) and the grain pipeline. With
``checkpoint.dir`` set and a checkpoint in it, the run resumes from the latest one: parameters,
optimiser state, RNG key and the data iterator's position, so it continues the identical run
(same batches, same losses). It then trains to ``run.steps``:

- metrics are fetched one step late (the device never waits for the host), except before a
  checkpoint or an evaluation, so nothing is saved after a step whose loss or gradient norm is
  NaN/inf: that raises ``NonFiniteLossError`` and the latest checkpoint is the last good one;
- checkpoints every ``checkpoint.every`` steps, at the end, and when a SIGTERM arrives (or after
  step ``stop_at``): then the run saves and returns early;
- evaluation on the held-out set (its batches drawn once) every ``logging.eval_every`` steps
  and at the end.

The RNG key saved with the checkpoints is the run's (``run.seed``); the models have no stochastic
layers, so it only seeds the initialisation.
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rich.console import Console

from precond_linattn.models import LanguageModel, ModelConfig
from train.build import data_spec, flops_per_token, model_config
from train.checkpoint import Checkpointer
from train.config import ExperimentConfig
from train.data import DataSpec, build_dataset, make_task
from train.metrics import Monitor
from train.optim import lr_schedule, make_optimizer
from train.partitioning import annotate
from train.sharding import drop_mesh_axis, init_sharded, logical_sharding, make_mesh, state_shardings
from train.step import StepShardings, device_batch, make_eval_step, make_train_step


@dataclasses.dataclass
class RunResult:
    """name; variant (the paper's model name); num_params; step (the last one done); losses
    ({step: loss} of the steps this call trained); evaluation (the last held-out metrics: loss,
    accuracy; empty without evaluation); stopped (early, by SIGTERM or ``stop_at``)."""

    name: str
    variant: str
    num_params: int
    step: int
    losses: dict[int, float]
    evaluation: dict[str, float]
    stopped: bool


@dataclasses.dataclass
class Setup:
    """Everything a run computes with, before any step (``build``)."""

    mesh: Mesh
    data: DataSpec
    task: object  # make_task(data), built once: its vocabulary sized the model
    model_config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    opt_state: object
    shardings: StepShardings
    train_step: typing.Callable


def build(cfg: ExperimentConfig, *, devices=None) -> Setup:
    """The mesh over ``devices`` (default: all), the data spec and task, the sharded model and
    optimiser states, and the jitted train step of ``cfg``."""
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    spec = data_spec(cfg)
    task = make_task(spec)
    model_cfg = model_config(cfg, task.vocab_size)
    A, B = cfg.optim.grad_accum, cfg.run.batch_size
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    if (B // A) % rows:
        raise ValueError(f"the micro-batch of run.batch_size / optim.grad_accum = {B // A} rows does not "
                         f"divide over mesh.data × mesh.fsdp = {rows} devices")
    tx = make_optimizer(cfg.optim, total_steps=cfg.run.steps)
    model = init_sharded(lambda: annotate(LanguageModel(model_cfg, rngs=nnx.Rngs(cfg.run.seed))), mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_shardings = state_shardings(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)  # placed by init_sharded
    shardings = StepShardings(param_shardings, opt_shardings, drop_mesh_axis(param_shardings, "fsdp"),
                              logical_sharding(mesh, (None, "batch")), NamedSharding(mesh, PartitionSpec()))
    return Setup(mesh, spec, task, model_cfg, graphdef, params, opt_state, shardings,
                 make_train_step(graphdef, tx, shardings, remat=cfg.run.remat,
                                 scan_layers=cfg.run.scan_layers))


def train(cfg: ExperimentConfig, *, stop_at: int | None = None, devices=None,
          console: Console | None = None) -> RunResult:
    """Run (or resume) the experiment ``cfg`` on ``devices`` (default: all); module docstring.
    ``stop_at``: stop after that step as if preempted (saving a checkpoint when they are on)."""
    console = console or Console()
    say = console.print if jax.process_index() == 0 else (lambda *a, **k: None)
    setup = build(cfg, devices=devices)
    model_cfg, shardings, train_step = setup.model_config, setup.shardings, setup.train_step
    params, opt_state, mesh = setup.params, setup.opt_state, setup.mesh
    A, B, T, steps = cfg.optim.grad_accum, cfg.run.batch_size, cfg.run.seq_len, cfg.run.steps
    data, rng, start = iter(build_dataset(setup.data, task=setup.task)), jax.random.key(cfg.run.seed), 0
    num_params = sum(x.size for x in jax.tree.leaves(params))  # tied embeddings count once

    checkpointer = Checkpointer(cfg.checkpoint) if cfg.checkpoint.dir else None
    if checkpointer is not None and checkpointer.latest_step() is not None:
        restored = checkpointer.restore(model=params, opt=opt_state)
        params, opt_state, rng, start = restored.model, restored.opt, restored.rng, restored.step
        data.set_state(restored.data_state)
    say(f"[bold]{cfg.name}[/bold]: {model_cfg.layer.variant}, {num_params / 1e6:.2f}M parameters, "
        f"mesh {dict(mesh.shape)}, {B} × {T} tokens per step"
        + (f", resuming after step {start}" if start else ""))

    monitor = Monitor(cfg.logging, total_steps=steps, tokens_per_step=B * T, start_step=start,
                      flops_per_token=flops_per_token(model_cfg, num_params), console=console)
    evaluate = Evaluator(cfg, setup.graphdef, shardings, setup.task) if cfg.logging.eval_every else None
    # the learning rates of all steps, once on the host (a device op per step would wait for
    # the step in flight and undo the one-step-late metrics)
    lrs = np.asarray(jax.device_get(jax.vmap(lr_schedule(cfg.optim, steps))(np.arange(steps))))
    result = RunResult(cfg.name, model_cfg.layer.variant, num_params, start, {}, {}, False)
    pending = []  # (step, device metrics) not yet checked and recorded

    def record():
        for s, metrics in pending:
            host = {k: float(v) for k, v in jax.device_get(metrics).items()}
            host["lr"] = float(lrs[s - 1])
            monitor.update(s, host)  # raises NonFiniteLossError first on a NaN/inf loss or grad_norm
            result.losses[s] = host["loss"]
        pending.clear()

    param_leaves, opt_leaves = shardings.leaves(params, opt_state)  # the step's form (train.step)
    try:
        for step in range(start + 1, steps + 1):
            batch = device_batch(next(data), A, shardings.batch)
            param_leaves, opt_leaves, metrics = train_step(param_leaves, opt_leaves, batch)
            record()  # the previous step's metrics, while this step runs
            pending.append((step, metrics))
            result.step, last = step, step == steps
            stop = not last and ((stop_at is not None and step >= stop_at)
                                 or bool(checkpointer and checkpointer.stop_requested))
            if evaluate and (step % cfg.logging.eval_every == 0 or last):
                record()
                result.evaluation = evaluate(shardings.trees(param_leaves, opt_leaves)[0])
                monitor.write_eval(step, result.evaluation)
                say(f"eval at step {step}: "
                    + ", ".join(f"{k} {v:.4f}" for k, v in result.evaluation.items()))
            if checkpointer and (checkpointer.should_save(step, last=last) or stop):
                record()
                params, opt_state = shardings.trees(param_leaves, opt_leaves)
                checkpointer.save(step, model=params, opt=opt_state, rng=rng, data_state=data.get_state())
            if stop:
                result.stopped = True
                say(f"stopped after step {step}" + (" (checkpoint saved)" if checkpointer else ""))
                break
        record()
    finally:
        monitor.close()
        if checkpointer:
            checkpointer.close()
    return result


class Evaluator:
    """Loss and accuracy on the supervised tokens (MQAR: the query positions) of the first
    ``logging.eval_batches`` batches of the held-out set (``train.build.data_spec``) of ``task``:

        loss = Σ nll / Σ count,   accuracy = Σ correct / Σ count   (sums over those batches)

    The batches are drawn and placed on the devices once; the sums stay on the devices until the
    single fetch at the end of an evaluation."""

    def __init__(self, cfg: ExperimentConfig, graphdef, shardings: StepShardings, task):
        data = iter(build_dataset(data_spec(cfg, evaluation=True), task=task))
        self.batches = [device_batch(next(data), 1, shardings.batch) for _ in range(cfg.logging.eval_batches)]
        self.step = make_eval_step(graphdef, shardings, scan_layers=cfg.run.scan_layers)

    def __call__(self, params) -> dict[str, float]:
        totals = None
        for batch in self.batches:
            sums = self.step(params, batch)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        totals = {k: float(v) for k, v in jax.device_get(totals).items()}
        count = max(totals["count"], 1.0)
        return dict(loss=totals["nll"] / count, accuracy=totals["correct"] / count)
