"""Observability: a rich progress bar, JSONL and TensorBoard metrics, throughput, MFU, a NaN check.

``Monitor.update(step, metrics)`` is called once per optimizer step with host scalars (the loop may
fetch them one step late so the device never waits). Every ``LoggingConfig.every`` steps it adds
``tokens_per_s``, ``step_time`` and, when the FLOPs per token and the device's peak are known,
``mfu``, and writes them to ``DIR/metrics.jsonl`` and TensorBoard event files in ``DIR/tb``.
Throughput is measured between calls, so the first step (compilation) is never counted.
"""

import json
import math
import time
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from tensorboardX import SummaryWriter

from train.config import LoggingConfig

# Dense bf16 peak FLOP/s per device, matched as a substring of ``jax.Device.device_kind``.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v4": 275e12, "TPU v5p": 459e12,
              "TPU v5 lite": 197e12, "TPU v6 lite": 918e12}


class NonFiniteLossError(FloatingPointError):
    """The loss (or another checked metric) became NaN or infinite."""


def peak_flops(device_kind: str) -> float | None:
    """The peak bf16 FLOP/s of one device of ``device_kind``, None when unknown (e.g. CPU)."""
    return next((v for k, v in PEAK_FLOPS.items() if k in device_kind), None)


def check_finite(step: int, metrics: dict, keys=("loss", "grad_norm")):
    """Raise ``NonFiniteLossError`` when a metric in ``keys`` (those present) is NaN or inf. The
    training loop saves no checkpoint after this, so the latest checkpoint stays the last good one."""
    bad = {k: metrics[k] for k in keys if k in metrics and not math.isfinite(metrics[k])}
    if bad:
        raise NonFiniteLossError(f"non-finite {bad} at step {step}: stopping the run; the latest checkpoint "
                                 f"(saved before step {step}) is the last good one")


class MetricsWriter:
    """Scalars (Python, numpy or 0-d jax numbers) to ``dir/metrics.jsonl`` (one object per line,
    with ``step``) and TensorBoard."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.directory / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(self.directory / "tb"))

    def write(self, step: int, scalars: dict):
        scalars = {k: float(v) for k, v in scalars.items()}
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        for k, v in scalars.items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self):
        self._jsonl.close()
        self._tb.close()


class Monitor:
    """Progress bar, periodic metric writing, throughput and MFU, and the run's one NaN/inf check
    (``check_finite`` of loss and grad_norm, before anything is recorded).

    tokens_per_step: tokens of one optimizer step over all devices; flops_per_token: model FLOPs
    (forward + backward) per token, None to omit MFU. Only process 0 writes and shows the bar."""

    def __init__(self, cfg: LoggingConfig, *, total_steps: int, tokens_per_step: int, start_step: int = 0,
                 flops_per_token: float | None = None, console: Console | None = None):
        self.cfg, self.tokens_per_step = cfg, tokens_per_step
        main = jax.process_index() == 0
        self.writer = MetricsWriter(cfg.dir) if cfg.dir and main else None
        peak = peak_flops(jax.devices()[0].device_kind)
        self.peak_total = peak * jax.device_count() if peak and flops_per_token else None
        self.flops_per_token = flops_per_token
        self.progress = None
        if cfg.progress and main:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]} tok/s"),
                                     TimeRemainingColumn(), console=console)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               loss=float("nan"), tps="-")
            self.progress.start()
        self._last = None  # (step, time) of the previous update

    def update(self, step: int, metrics: dict) -> dict | None:
        """Record optimizer step ``step``'s scalar ``metrics``; returns what was written, if any.
        A NaN/inf loss or grad_norm raises ``NonFiniteLossError`` before anything is recorded."""
        check_finite(step, metrics)
        now, written = time.perf_counter(), None
        if self._last is not None and step % self.cfg.every == 0:
            last_step, last_time = self._last
            step_time = (now - last_time) / (step - last_step)
            written = dict(metrics, step_time=step_time, tokens_per_s=self.tokens_per_step / step_time)
            if self.peak_total:
                written["mfu"] = written["tokens_per_s"] * self.flops_per_token / self.peak_total
            if self.writer:
                self.writer.write(step, written)
            if self.progress:
                self.progress.update(self.task, tps=f"{written['tokens_per_s']:,.0f}")
        if self._last is None or written:
            self._last = (step, now)
        if self.progress:
            self.progress.update(self.task, completed=step, loss=metrics.get("loss", float("nan")))
        return written

    def write_eval(self, step: int, metrics: dict):
        """Write evaluation metrics as ``eval/<name>``."""
        if self.writer:
            self.writer.write(step, {f"eval/{k}": v for k, v in metrics.items()})

    def close(self):
        if self.progress:
            self.progress.stop()
        if self.writer:
            self.writer.close()
