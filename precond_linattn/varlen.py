"""Document structure of a batch: which token belongs to which document.

Without ``cu_seqlens`` every batch row is one document (N = B). With ``cu_seqlens`` (B = 1)
documents are packed along T and every recurrent state restarts at each boundary. Two views:

- ``Segments``: per token, for the token-by-token references.
- ``ChunkLayout``: document-aligned chunks of C tokens for the chunked forms. A chunk never
  straddles two documents; the tail of a document's last chunk is padding. Padding tokens carry
  k = k̃ = q = v = 0, beta = 0, log decay = 0 and retention = 1, which leaves every recurrence of
  this package unchanged, so a document's final state is the state after its last chunk.
"""

from typing import NamedTuple

import jax.numpy as jnp

from precond_linattn._typing import Array, Bool, Int


class Segments(NamedTuple):
    doc: Int[Array, "b t"]     # document index of each token (row of initial/final states)
    first: Bool[Array, "b t"]  # the token starts its document
    last: Bool[Array, "b t"]   # the token ends its document
    num_docs: int


def segments(batch: int, length: int, cu_seqlens=None) -> Segments:
    """Per-token document index and boundary flags."""
    t = jnp.arange(length)
    if cu_seqlens is None:
        doc = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
        first = jnp.broadcast_to(t == 0, (batch, length))
        last = jnp.broadcast_to(t == length - 1, (batch, length))
        return Segments(doc, first, last, batch)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    doc = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    first = t == cu[doc]
    last = t == cu[doc + 1] - 1
    return Segments(doc[None], first[None], last[None], cu.shape[0] - 1)


class ChunkLayout(NamedTuple):
    index: Int[Array, "b nc c"] | None  # source token of each slot (T = padding); None: dense
    doc: Int[Array, "b nc"]             # document of each chunk
    first: Bool[Array, "b nc"]          # the chunk starts its document (state resets before it)
    final_row: Int[Array, "n"]          # batch row holding each document's last chunk
    final_chunk: Int[Array, "n"]        # index of each document's last chunk
    length: int                         # T
    chunk: int                          # C
    num_docs: int                       # N


def chunk_layout(batch: int, length: int, chunk: int, cu_seqlens=None) -> ChunkLayout:
    """Document-aligned chunks: dense (pad T up to a multiple of C) or gathered from packed docs."""
    if cu_seqlens is None:
        nc = -(-length // chunk)
        doc = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, nc))
        first = jnp.broadcast_to(jnp.arange(nc) == 0, (batch, nc))
        return ChunkLayout(None, doc, first, jnp.arange(batch), jnp.full((batch,), nc - 1),
                           length, chunk, batch)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n = cu.shape[0] - 1
    nc_max = length // chunk + n  # >= sum_i ceil(len_i / C)
    chunks_per_doc = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    chunk_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks_per_doc)])
    c = jnp.arange(nc_max)
    used = c < chunk_start[-1]
    doc = jnp.minimum(jnp.searchsorted(chunk_start[1:], c, side="right"), n - 1)
    local = c - chunk_start[doc]
    token = cu[doc][:, None] + local[:, None] * chunk + jnp.arange(chunk)[None, :]
    valid = used[:, None] & (token < cu[doc + 1][:, None])
    index = jnp.where(valid, token, length)
    first = used & (local == 0)
    return ChunkLayout(index[None], doc[None], first[None], jnp.zeros((n,), jnp.int32),
                       chunk_start[1:] - 1, length, chunk, n)


def to_chunks(x, layout: ChunkLayout, fill: float = 0.0):
    """[B, T, ...] -> [B, NC, C, ...]; padding slots hold ``fill``."""
    b, c = x.shape[0], layout.chunk
    if layout.index is None:
        nc = layout.doc.shape[1]
        pad = [(0, 0), (0, nc * c - layout.length)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, pad, constant_values=fill).reshape(b, nc, c, *x.shape[2:])
    padded = jnp.concatenate([x, jnp.full((b, 1, *x.shape[2:]), fill, x.dtype)], axis=1)
    return padded[jnp.arange(b)[:, None, None], layout.index]


def from_chunks(y, layout: ChunkLayout):
    """[B, NC, C, ...] -> [B, T, ...], dropping padding slots."""
    b = y.shape[0]
    if layout.index is None:
        flat = y.reshape(b, -1, *y.shape[3:])
        return flat[:, : layout.length]
    out = jnp.zeros((b, layout.length, *y.shape[3:]), y.dtype)
    return out.at[jnp.arange(b)[:, None, None], layout.index].set(y, mode="drop")


def reset(carry, initial, doc, first):
    """Restart each batch row whose chunk or token starts a document: initial[doc] (zeros if None)."""
    start = jnp.zeros_like(carry) if initial is None else initial[doc]
    return jnp.where(first.reshape(first.shape + (1,) * (carry.ndim - 1)), start, carry)
