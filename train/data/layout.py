"""The batch every pipeline yields, and its document boundaries.

A batch is a dict of int32 numpy arrays (B rows of T tokens, on each host its share of the rows):

    inputs       [B, T]      token ids; padding holds the tokenizer's PAD id
    targets      [B, T]      the token to predict at each position, or IGNORE_INDEX (-100) where
                             there is no loss: padding, MQAR's non-query positions

and, from the packed tasks only (rows of several documents; an MQAR row is one example):

    segment_ids  [B, T]      document of each token within its row: 1, 2, ... in row order;
                             0 marks padding (grain's convention)
    positions    [B, T]      offset of each token within its document (0 at a document's start);
                             0 on padding
    cu_seqlens   [B, S + 1]  per row, the offsets [0, t_1, ..., T] of its S_b segments (each
                             document, and the row's trailing padding run as one more segment),
                             padded on the right with T up to the fixed width S + 1 so the shape
                             never changes between batches

Every recurrent state (and the short convolution) must restart at each segment start.
``precond_linattn`` takes documents packed along T with B = 1: for a batch of one row pass
``cu_seqlens[0]``; for B > 1 reshape the tokens to [1, B·T] and pass ``flatten_cu_seqlens``.
The repeated trailing offsets are empty documents, which the package's ops skip (checked in
tests/test_data.py under ``jax.jit``). Outside jit the ops reject non-increasing offsets; there use
``np.unique(cu_seqlens[b])`` for row b.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

IGNORE_INDEX = -100


def row_cu_seqlens(segment_ids: np.ndarray, max_segments: int) -> np.ndarray:
    """[B, T] segment ids -> [B, max_segments + 1] per-row segment offsets padded with T.

    A segment is a maximal run of equal ids (a document, or the trailing padding run).
    """
    B, T = segment_ids.shape
    out = np.full((B, max_segments + 1), T, np.int32)
    for b, row in enumerate(segment_ids):
        starts = np.flatnonzero(np.diff(row, prepend=row[0] - 1))
        if len(starts) > max_segments:
            raise ValueError(f"row {b} has {len(starts)} segments; at most {max_segments} fit")
        out[b, : len(starts)] = starts
    return out


def flatten_cu_seqlens(cu_seqlens, length: int):
    """[B, S + 1] per-row offsets (rows of ``length`` tokens) -> [B·S + 1] offsets of the
    [1, B·T] flattening; row b's offsets shift by b·T, its padded entries become empty documents."""
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    shifted = cu[:, :-1] + length * jnp.arange(cu.shape[0], dtype=jnp.int32)[:, None]
    return jnp.concatenate([shifted.reshape(-1), jnp.full((1,), cu.shape[0] * length, jnp.int32)])


@dataclasses.dataclass(frozen=True)
class AddCuSeqlens:
    """Batch -> the batch with ``cu_seqlens`` [B, max_segments + 1] from its ``segment_ids``."""

    max_segments: int

    def __call__(self, batch: dict) -> dict:
        return {**batch, "cu_seqlens": row_cu_seqlens(batch["segment_ids"], self.max_segments)}
