"""Input pipelines: MQAR (Zoology's generator), text from local files, a built-in tiny corpus.

    spec = DataSpec(task="mqar", params=dict(seq_len=256, num_kv_pairs=16), batch_size=64)
    it = iter(build_dataset(spec))     # a grain.DatasetIterator of batches
    batch = next(it)                   # dict of int32 numpy arrays, see train.data.layout
    state = it.get_state()             # save with the checkpoint; it.set_state(state) resumes

Modules: ``layout`` (the batch and its document boundaries), ``mqar``, ``vocab`` (tokenizers),
``sources`` (files, tiny corpus), ``packing``, ``text`` (the text tasks), ``pipeline`` (spec,
registry, grain pipeline, host sharding).
"""

from train.data.layout import IGNORE_INDEX, flatten_cu_seqlens, row_cu_seqlens
from train.data.mqar import MQARTask
from train.data.pipeline import TASKS, DataSpec, build_dataset, make_task
from train.data.text import TextTask, TinyTextTask
from train.data.vocab import BPETokenizer, ByteTokenizer

__all__ = ["IGNORE_INDEX", "flatten_cu_seqlens", "row_cu_seqlens", "MQARTask", "TASKS", "DataSpec",
           "build_dataset", "make_task", "TextTask", "TinyTextTask", "BPETokenizer", "ByteTokenizer"]
