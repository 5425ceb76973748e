"""Document structure of a batch: which token belongs to which document.

Without ``cu_seqlens`` every batch row is one document (N = B). With ``cu_seqlens`` (B = 1)
documents are packed along T and every recurrent state restarts at each boundary. Two views:

- ``Segments``: per token, for the token-by-token references.
- ``ChunkLayout``: document-aligned chunks of C tokens for the chunked forms. A chunk never
  straddles two documents; the tail of a document's last chunk is padding. Padding tokens carry
  k = k̃ = q = v = 0, beta = 0, log decay = 0 and retention = 1, which leaves every recurrence of
  this package unchanged, so a document's final state is the state after its last chunk.

Packed documents move between the token and chunk layouts by gathers only, in both directions
and in both passes (``gather_rows``): slots take their token (``index``), tokens take their slot
(``slot``), and each map's cotangent is the other gather. XLA's transpose of a gather is a
scatter-add, which on a GPU costs atomics for what is a permutation (a packed-rows train step of
the 340M DeltaNet ran 31 % slower than dense rows: RESULTS run 25).
"""

from typing import NamedTuple

import jax
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
    slot: Int[Array, "t"] | None        # slot (flat NC·C) of each token (NC·C: none); None: dense
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
        return ChunkLayout(None, None, doc, first, jnp.arange(batch), jnp.full((batch,), nc - 1),
                           length, chunk, batch)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n = cu.shape[0] - 1
    nc_max = (length + n * (chunk - 1)) // chunk  # >= sum_i ceil(len_i / C), sum_i len_i <= T
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
    t = jnp.arange(length)
    tdoc = segments(batch, length, cu).doc[0]  # n: after the last document
    tlocal = t - cu[jnp.minimum(tdoc, n - 1)]
    slot = jnp.where(tdoc < n, (chunk_start[jnp.minimum(tdoc, n - 1)] + tlocal // chunk) * chunk
                     + tlocal % chunk, nc_max * chunk)
    return ChunkLayout(index[None], slot, doc[None], first[None], jnp.zeros((n,), jnp.int32),
                       chunk_start[1:] - 1, length, chunk, n)


@jax.custom_vjp
def gather_rows(x, rows, back):
    """y[:, i] = x[:, rows[i]] for x [B, N, ...] and rows [M]: a gather whose cotangent is a gather
    too, dx[:, j] = dy[:, back[j]] (M: zero). Requires that ``rows`` take each row j of x at most
    once, at i = back[j]; back[j] = M for a row no i takes or one whose cotangent is dropped (a
    constant padding row)."""
    return jnp.take(x, rows, axis=1)


def _gather_rows_fwd(x, rows, back):
    return gather_rows(x, rows, back), back


def _gather_rows_bwd(back, dy):
    zero = jnp.zeros((dy.shape[0], 1, *dy.shape[2:]), dy.dtype)
    return jnp.take(jnp.concatenate([dy, zero], axis=1), back, axis=1), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def to_chunks(x, layout: ChunkLayout, fill: float = 0.0):
    """[B, T, ...] -> [B, NC, C, ...]; padding slots hold ``fill``."""
    b, c = x.shape[0], layout.chunk
    nc = layout.doc.shape[1]
    if layout.index is None:
        pad = [(0, 0), (0, nc * c - layout.length)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, pad, constant_values=fill).reshape(b, nc, c, *x.shape[2:])
    padded = jnp.concatenate([x, jnp.full((b, 1, *x.shape[2:]), fill, x.dtype)], axis=1)
    back = jnp.append(layout.slot, nc * c)  # the fill row: no slot's cotangent
    return gather_rows(padded, layout.index.reshape(-1), back).reshape(b, nc, c, *x.shape[2:])


def from_chunks(y, layout: ChunkLayout):
    """[B, NC, C, ...] -> [B, T, ...], dropping padding slots."""
    b = y.shape[0]
    flat = y.reshape(b, -1, *y.shape[3:])
    if layout.index is None:
        return flat[:, : layout.length]
    zero = jnp.zeros((b, 1, *flat.shape[2:]), y.dtype)  # the slot of tokens outside any document
    return gather_rows(jnp.concatenate([flat, zero], axis=1), layout.slot,
                       jnp.append(layout.index.reshape(-1), layout.length))


def reset(carry, initial, doc, first):
    """Restart each batch row whose chunk or token starts a document: initial[doc] (zeros if None)."""
    start = jnp.zeros_like(carry) if initial is None else initial[doc]
    return jnp.where(first.reshape(first.shape + (1,) * (carry.ndim - 1)), start, carry)
