"""Typed experiment configs: nested frozen dataclasses, ``configs/NAME.py`` files and overrides.

A config file defines ``get_config() -> ExperimentConfig`` and, for a sweep, ``VARIANTS``: a dict
of run name -> overrides (``load_runs``; e.g. {"DeltaNet": ["model.kwargs.preconditioner=none"]}).
Overrides are ``key=value`` strings with
dotted paths (``optim.peak_lr=3e-4``, ``mesh.fsdp=4``, ``model.kwargs.num_layers=2``); the value is
converted to the field's type (int, float, bool, str, ``X | None`` with "none", tuples as "1,2").
Inside the dict fields (``model.kwargs``, ``data.params``) any key is accepted and the value is read
as a Python literal when it parses as one, else kept as a string. Any other unknown key is a
``ValueError`` that lists the valid keys and suggests the closest.
"""

import ast
import dataclasses
import difflib
import fnmatch
import importlib.util
import types
import typing
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model preset name (``precond_linattn.models.PRESETS``; "" for none) and keyword arguments
    for the model config (e.g. ``preconditioner``, or every field when there is no preset)."""

    preset: str = ""
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """A data task name (``train.data``) and its parameters."""

    task: str = "mqar"
    params: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay from ``peak_lr`` to ``min_lr``.

    total_steps: optimizer updates the schedule spans; None: ``run.steps`` (passed to
      ``train.optim.make_optimizer``).
    grad_accum: micro-batches per update, accumulated inside the train step; the schedule counts
      updates.
    no_decay: regexes searched in each parameter's "/"-joined path; matching parameters, and every
      parameter of ndim ≤ 1, get no weight decay (see ``train.optim.weight_decay_mask``).
    """

    name: str = "adamw"
    peak_lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    total_steps: int | None = None
    schedule: str = "cosine"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-15
    grad_accum: int = 1
    no_decay: tuple[str, ...] = ("bias", "norm", "A_log", "dt_bias", "log_atk_scale", "eta",
                                 "retention", "init")

    def __post_init__(self):
        if self.name != "adamw":
            raise ValueError(f"optim.name must be 'adamw', got {self.name!r}")
        if self.schedule != "cosine":
            raise ValueError(f"optim.schedule must be 'cosine', got {self.schedule!r}")
        if not 0 <= self.min_lr <= self.peak_lr:
            raise ValueError(f"need 0 <= optim.min_lr <= optim.peak_lr, got {self.min_lr}, {self.peak_lr}")
        if self.grad_accum < 1 or self.warmup_steps < 0:
            raise ValueError("optim.grad_accum must be >= 1 and optim.warmup_steps >= 0")
        if self.total_steps is not None and self.warmup_steps >= self.total_steps:
            raise ValueError(f"optim.warmup_steps ({self.warmup_steps}) must be < optim.total_steps "
                             f"({self.total_steps})")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; one of them may be -1 for "all remaining devices"."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in ``dir`` ("" disables them) every ``every`` steps and at the end."""

    dir: str = ""
    every: int = 1000
    keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"need checkpoint.every, keep >= 1, got {self.every}, {self.keep}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """JSONL and TensorBoard metrics in ``dir`` ("" for none) every ``every`` steps; evaluation
    every ``eval_every`` steps and at the end (0 for never) on ``eval_batches`` held-out batches;
    ``progress`` shows a progress bar."""

    dir: str = ""
    every: int = 10
    eval_every: int = 0
    eval_batches: int = 8
    progress: bool = True

    def __post_init__(self):
        if self.every < 1 or self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"need logging.every >= 1, eval_every >= 0, eval_batches >= 1, got "
                             f"{self.every}, {self.eval_every}, {self.eval_batches}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """steps: optimizer updates; batch_size: sequences per update (global, all micro-batches);
    compute_dtype: activations' dtype (weights stay float32); remat: rematerialise each block;
    scan_layers: run the blocks as a ``lax.scan`` over their stacked parameters (one block to
    compile; ``train.step.forward``)."""

    seed: int = 42
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 2048
    remat: bool = False
    scan_layers: bool = False
    compute_dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self):
        total = self.optim.total_steps or self.run.steps
        if self.optim.warmup_steps >= total:
            raise ValueError(f"optim.warmup_steps ({self.optim.warmup_steps}) must be < the schedule's "
                             f"{total} steps (optim.total_steps, else run.steps)")
        if self.run.batch_size % self.optim.grad_accum:
            raise ValueError(f"run.batch_size ({self.run.batch_size}) must be a multiple of "
                             f"optim.grad_accum ({self.optim.grad_accum})")


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> ExperimentConfig:
    """Run ``get_config()`` of the Python file ``path`` and apply ``key=value`` ``overrides``."""
    return apply_overrides(_load_module(path).get_config(), overrides)


def load_runs(path: str | Path, overrides: typing.Sequence[str] = (),
              only: typing.Sequence[str] = ()) -> dict[str, ExperimentConfig]:
    """The runs of the config file ``path``: {name: config}. Without ``VARIANTS``, one run named
    ``name``. With it, one run per variant (those matching a glob of ``only``, when given): its
    overrides, then ``overrides`` (so the command line wins); the name becomes "NAME/VARIANT" and
    non-empty checkpoint and logging directories get a VARIANT subdirectory."""
    module = _load_module(path)
    base = module.get_config()
    variants = getattr(module, "VARIANTS", None)
    if variants is None:
        cfg = apply_overrides(base, overrides)
        return {cfg.name: cfg}
    chosen = [v for v in variants if not only or any(fnmatch.fnmatchcase(v, p) for p in only)]
    if not chosen:
        raise ValueError(f"no variant of {path} matches {list(only)}; variants: {list(variants)}")
    runs = {}
    for variant in chosen:
        cfg = apply_overrides(base, [*variants[variant], *overrides])
        sub = lambda d: str(Path(d) / variant) if d else d
        cfg = dataclasses.replace(
            cfg, name=f"{cfg.name}/{variant}",
            checkpoint=dataclasses.replace(cfg.checkpoint, dir=sub(cfg.checkpoint.dir)),
            logging=dataclasses.replace(cfg.logging, dir=sub(cfg.logging.dir)))
        runs[cfg.name] = cfg
    return runs


def _load_module(path: str | Path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path} defines no get_config()")
    return module


def apply_overrides(config, overrides: typing.Sequence[str]):
    """A copy of the dataclass ``config`` with each ``dotted.key=value`` of ``overrides`` set; the
    dataclasses validate the result once, so the order of the overrides does not matter."""
    changes = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not of the form key=value")
        parts = key.strip().split(".")
        target = changes
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = _parse(config, parts, text.strip())
    return _replace(config, changes)


def valid_keys(config, prefix: str = "") -> list[str]:
    """Every dotted key of the dataclass ``config`` (dict fields end in ``.<key>``)."""
    keys = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            keys += valid_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}" + (".<key>" if isinstance(value, dict) else ""))
    return keys


def _parse(config, parts, text):
    """The value ``text`` for the dotted key ``parts`` of ``config``; ValueError for unknown keys."""
    node, key = config, ".".join(parts)
    for i, name in enumerate(parts):
        hints = typing.get_type_hints(type(node))
        if name not in hints:
            break
        value, rest = getattr(node, name), parts[i + 1:]
        if isinstance(value, dict) and len(rest) == 1:
            return _literal(text)
        if not isinstance(value, dict) and not dataclasses.is_dataclass(value) and not rest:
            return _convert(text, hints[name], key)
        if not (dataclasses.is_dataclass(value) and rest):
            break
        node = value
    valid = valid_keys(config)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown config key {key!r}.{hint} Valid keys: {', '.join(valid)}")


def _replace(node, changes: dict):
    """``node`` with the nested ``changes`` applied, each dataclass rebuilt once."""
    new = {}
    for name, change in changes.items():
        value = getattr(node, name)
        new[name] = (_replace(value, change) if dataclasses.is_dataclass(value)
                     else {**value, **change} if isinstance(value, dict) else change)
    return dataclasses.replace(node, **new)


def _literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _convert(text, tp, key):
    """``text`` as a value of type ``tp``."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _convert(text, tp, key)
    if typing.get_origin(tp) is tuple:
        items = [s.strip() for s in text.strip("()[]").split(",") if s.strip()]
        return tuple(_convert(s.strip("'\""), args[0], key) for s in items)
    if tp is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{key}: expected a bool (true/false), got {text!r}")
    try:
        value = tp(float(text)) if tp is int and float(text).is_integer() else tp(text)  # int "1e3"
    except ValueError:
        raise ValueError(f"{key}: expected {tp.__name__}, got {text!r}") from None
    return value
