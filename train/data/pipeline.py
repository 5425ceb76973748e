"""One spec -> one grain pipeline of batches, resumable from its iterator state.

    source(seed)            grain.MapDataset: MQAR examples or document strings, by index
    [p::P]                  host sharding: process p of P keeps elements p, p + P, p + 2P, ...
                            (p = jax.process_index(), P = jax.process_count() unless given)
    .shuffle(seed)          a global permutation of the host's slice, a different one per epoch
    .repeat(num_epochs)     None: forever
    task.rows(...)          tokenize, pack and add cu_seqlens (text), batch to batch_size / P rows;
                            ends with to_iter_dataset(ReadOptions(read_threads, read_buffer_size))
    .mp_prefetch(...)       with worker_count > 0: that many worker processes, each producing
                            the batches of its slice of the MapDataset stage

``iter(build_dataset(spec))`` is a ``grain.DatasetIterator``: ``get_state()`` is a small JSON-able
dict to store with a checkpoint, and ``set_state(state)`` on a fresh iterator of the same spec
continues the identical stream. The stream depends on the spec and on P; for the packed text
tasks it also depends on worker_count (each worker packs its own documents), so a resumed run
keeps both. Batches are dicts of int32 numpy arrays, laid out as ``train.data.layout`` says;
each host yields its B / P rows, which the train step assembles into the global batch (e.g.
``jax.make_array_from_process_local_data``).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import grain
import jax
from absl import flags

from train.data.mqar import MQARTask
from train.data.text import TextTask, TinyTextTask

TASKS = {"mqar": MQARTask, "text": TextTask, "tiny_text": TinyTextTask}
"""Task name -> its frozen parameter dataclass (fields = the accepted ``DataSpec.params`` keys).

A task has ``seq_len`` and ``vocab_size`` (to size the model), ``source(seed)`` (a MapDataset of
examples or documents) and ``rows(elements, batch_size, read_options)`` (the batches)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
    """A data pipeline.

    task / params: a name in ``TASKS`` and keyword arguments of its dataclass.
    batch_size: global rows per batch (divided among the P processes).
    seed: seeds the shuffle and the generated tasks' content (MQAR, tiny_text).
    shuffle / num_epochs: shuffle each epoch; None repeats forever.
    read_threads / read_buffer_size: grain ReadOptions of the MapDataset stage.
    worker_count / worker_buffer_size: grain multiprocessing prefetch (0: in-process).
    """

    task: str = "mqar"
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    batch_size: int = 8
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    read_threads: int = 2
    read_buffer_size: int = 64
    worker_count: int = 0
    worker_buffer_size: int = 1


def make_task(spec: DataSpec):
    """The task dataclass of ``spec`` (its ``seq_len`` and ``vocab_size`` size the model)."""
    if spec.task not in TASKS:
        raise ValueError(f"unknown data task {spec.task!r}; expected one of {tuple(TASKS)}")
    cls = TASKS[spec.task]
    valid = tuple(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(spec.params) - set(valid))
    if unknown:
        raise ValueError(f"unknown params {unknown} for data task {spec.task!r}; valid: {valid}")
    return cls(**spec.params)


def build_dataset(spec: DataSpec, *, process_index: int | None = None, process_count: int | None = None,
                  task=None) -> grain.IterDataset:
    """The batches of ``spec`` read by process ``process_index`` of ``process_count``; ``task``:
    ``make_task(spec)`` when the caller has built it already (with its tokenizer), else built here."""
    p = jax.process_index() if process_index is None else process_index
    P = jax.process_count() if process_count is None else process_count
    if not 0 <= p < P:
        raise ValueError(f"process_index must be in [0, {P}), got {p}")
    if spec.batch_size < 1 or spec.batch_size % P:
        raise ValueError(f"batch_size must be a positive multiple of process_count={P}, "
                         f"got {spec.batch_size}")
    task = make_task(spec) if task is None else task
    ds = task.source(spec.seed)[p::P]
    if spec.shuffle:
        ds = ds.shuffle(spec.seed)
    ds = task.rows(ds.repeat(spec.num_epochs), spec.batch_size // P,
                   grain.ReadOptions(num_threads=spec.read_threads,
                                     prefetch_buffer_size=spec.read_buffer_size))
    if spec.worker_count:
        if not flags.FLAGS.is_parsed():
            # grain <= 0.2.18 reads an absl flag in mp_prefetch, which fails unless flags were
            # parsed (google/grain#1355); outside an absl program, take every flag's default.
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec.worker_count,
                                                         per_worker_buffer_size=spec.worker_buffer_size))
    return ds
