"""Greedy packing of tokenized documents into rows of T tokens.

A document of ids x = [BOS, ..., EOS] (n ids) becomes n − 1 (input, target) pairs
(x[t], x[t + 1]): every token predicts its successor inside the document, the EOS is never an
input, and no target crosses a document boundary. A document of more than ``max_doc_len`` pairs
is cut into consecutive pieces of at most ``max_doc_len`` pairs, each packed as its own document
(its recurrent state starts fresh; no pair is lost).

Pieces then fill rows greedily in stream order: a piece joins the current row if it fits and the
row holds fewer than ``max_docs_per_row`` documents, otherwise the row is emitted (padded) and a
new one begins with the piece. Padding has ``inputs`` = PAD, ``targets`` = IGNORE_INDEX,
``segment_ids`` = 0, ``positions`` = 0. Concatenating the documents of the emitted rows gives the
pairs of the input documents in order. Rows then carry the layout of ``train.data.layout``.
"""

import dataclasses

import grain
import numpy as np

from train.data.layout import IGNORE_INDEX
from train.data.vocab import encode_document


@dataclasses.dataclass(frozen=True)
class Tokenize:
    """Document text -> ``{"inputs": x[:-1], "targets": x[1:]}`` for x = [BOS] + ids + [EOS]."""

    tokenizer: object

    def __call__(self, text: str) -> dict:
        x = encode_document(self.tokenizer, text)
        return {"inputs": x[:-1], "targets": x[1:]}


class SplitDocument(grain.experimental.FlatMapTransform):
    """A document's pairs -> consecutive pieces of at most ``max_doc_len`` pairs."""

    def __init__(self, max_doc_len: int):
        self.max_doc_len = max_doc_len
        self.max_fan_out = np.iinfo(np.int32).max  # required by grain; only FlatMapMapDataset checks it

    def flat_map(self, doc: dict) -> list[dict]:
        n = len(doc["inputs"])
        return [{k: v[s: s + self.max_doc_len] for k, v in doc.items()}
                for s in range(0, n, self.max_doc_len)]


@dataclasses.dataclass(frozen=True)
class _ToLayout:
    """grain's packed row -> ``inputs``, ``targets``, ``segment_ids``, ``positions``."""

    def __call__(self, row: dict) -> dict:
        return {"inputs": row["inputs"], "targets": row["targets"],
                "segment_ids": row["inputs_segment_ids"], "positions": row["inputs_positions"]}


def pack_documents(docs: grain.IterDataset, *, seq_len: int, max_docs_per_row: int,
                   max_doc_len: int, pad_id: int) -> grain.IterDataset:
    """Tokenized documents (``Tokenize`` output) -> packed rows of ``seq_len`` (module docstring)."""
    if not 1 <= max_doc_len <= seq_len:
        raise ValueError(f"max_doc_len must be in [1, seq_len={seq_len}], got {max_doc_len}")
    if max_docs_per_row < 1:
        raise ValueError(f"max_docs_per_row must be >= 1, got {max_docs_per_row}")
    pieces = grain.experimental.FlatMapIterDataset(docs, SplitDocument(max_doc_len))
    rows = grain.experimental.FirstFitPackIterDataset(
        pieces, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=1,
        shuffle_bins=False, max_sequences_per_bin=max_docs_per_row,
        padding_struct={"inputs": pad_id, "targets": IGNORE_INDEX})
    return rows.map(_ToLayout())
