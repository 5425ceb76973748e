"""Orbax checkpoints of a training run: model and optimiser state, step, RNG key and data iterator.

Each step is a directory ``DIR/<step>`` with the items ``model`` and ``opt`` (``StandardSave`` of
any pytree, e.g. ``nnx.State``) and ``meta`` (JSON: step, RNG key data, the grain iterator state).
Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it when every item is
written, so a save that fails part-way leaves the previous checkpoints intact; the next
``Checkpointer`` on the directory deletes the leftover temporary directory (in the background).

SIGTERM (preemption): ``Checkpointer`` installs a handler that only sets ``stop_requested``; the
train loop then saves at the next step boundary (``should_save`` is True) and leaves the loop.
"""

import dataclasses
import signal
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from train.config import CheckpointConfig


class CheckpointError(RuntimeError):
    """A checkpoint is missing or cannot be restored."""


@dataclasses.dataclass
class Restored:
    step: int
    model: Any
    opt: Any
    rng: jax.Array
    data_state: dict | bytes | None


class Checkpointer:
    """Saves every ``cfg.every`` steps, at the end and after SIGTERM; keeps the last ``cfg.keep``.

    Use as a context manager (or call ``close``) so pending asynchronous saves finish and the
    previous SIGTERM handler is put back."""

    def __init__(self, cfg: CheckpointConfig, *, handle_sigterm: bool = True):
        if not cfg.dir:
            raise ValueError("checkpoint.dir is empty")
        self.cfg, self.directory = cfg, Path(cfg.dir).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=cfg.async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("model", "opt", "meta"))
        self.stop_requested = False
        self._previous_handler = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    def should_save(self, step: int, *, last: bool = False) -> bool:
        """Whether to save after optimizer step ``step``: every ``cfg.every``, at the last step, or
        after a SIGTERM (then the loop stops once the save is done)."""
        return last or self.stop_requested or step % self.cfg.every == 0

    def save(self, step: int, *, model, opt, rng: jax.Array, data_state: dict | bytes | None = None):
        """Save the state after ``step`` (asynchronous when ``cfg.async_save``; errors of an earlier
        asynchronous save are raised here or in ``wait``)."""
        typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
        meta = dict(step=step, rng_impl=str(jax.random.key_impl(rng)) if typed else None,
                    rng_data=jax.device_get(jax.random.key_data(rng) if typed else rng).tolist(),
                    data_state=_encode(data_state))
        self.manager.save(step, force=True, args=ocp.args.Composite(
            model=ocp.args.StandardSave(model), opt=ocp.args.StandardSave(opt), meta=ocp.args.JsonSave(meta)))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int | None = None, *, model, opt) -> Restored:
        """Restore ``step`` (default: the latest) with the structure, dtypes and shardings of the
        ``model`` and ``opt`` pytrees given (arrays or ``jax.ShapeDtypeStruct``s)."""
        steps = self.manager.all_steps()
        step = max(steps, default=None) if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint to restore in {self.directory}")
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; "
                                  f"steps: {sorted(steps)}")
        abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        try:
            r = self.manager.restore(step, args=ocp.args.Composite(
                model=ocp.args.StandardRestore(abstract(model)), opt=ocp.args.StandardRestore(abstract(opt)),
                meta=ocp.args.JsonRestore()))
            meta = r.meta
            rng = jax.numpy.asarray(meta["rng_data"], jax.numpy.uint32)
            if meta["rng_impl"] is not None:
                rng = jax.random.wrap_key_data(rng, impl=meta["rng_impl"])
            return Restored(meta["step"], r.model, r.opt, rng, _decode(meta["data_state"]))
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} is corrupt or does not match the "
                                  f"model/optimiser given: {type(e).__name__}: {e}") from e

    def wait(self):
        """Block until pending saves are written; raises if one failed."""
        self.manager.wait_until_finished()

    def close(self):
        try:
            self.manager.wait_until_finished()
        finally:
            self.manager.close()
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)
                self._previous_handler = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _encode(state):
    """A grain iterator state as JSON: dicts as they are, bytes (``DataLoader``) as UTF-8 text."""
    return {"bytes": state.decode()} if isinstance(state, bytes) else {"json": state}


def _decode(obj):
    return obj["bytes"].encode() if "bytes" in obj else obj["json"]
