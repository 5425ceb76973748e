"""The in-chunk sums of per-channel log decays (KDA's γ) and their pullback, as Mosaic GPU
kernels (Hopper):

    γ_t = Σ_{s<=t} g_s                                  (``decay_cumsum``)
    dg_t = Σ_{i>=t} dγ_i + Σ_{i<t} dσ_i                 (``decay_sums_pullback``)

for s, t, i in one chunk of C tokens; the second is the pullback of (γ, σ) with σ_i =
Σ_{s>i} g_s (``chunked.delta.decay_sums``). One CTA a (batch row, chunk, 128 channels), its
[C, 128] float32 tile in shared memory by TMA, one thread a channel walking the tile's rows
(``rows_mosaic.tokens``), so every sum adds only its own terms, in token order, and no thread
reads another's. They replace XLA's batched float32 0/1-mask matmuls, which run on CUDA cores
(0.311 ms forward and backward at 8x2048x8x128 on the H200, NOTES v8.7); these kernels move
the same bytes once.

The channels of all heads are taken 128 at a time (the [B, T, H, K] array viewed as [B, T,
H K / 128, 128]), so H K must be a multiple of 128 (``fits``).
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rows_mosaic import F32, K_THREADS, VEC, row, tokens
from pallas_kernels.state_mosaic import kernel
from pallas_kernels.triton_common import out_struct

COLS = K_THREADS  # channels a CTA: one a thread of a warpgroup
GRID = ("b", "c", "j")  # batch row, chunk, group of 128 channels


def fits(g, chunk):
    """Whether the kernels take log decays ``g`` [B, T, H, K] in chunks of ``chunk``: H K a
    multiple of 128, T of ``chunk``, and ``chunk`` (a TMA box's rows) at most 256."""
    B, T, H, K = g.shape
    return (H * K) % COLS == 0 and T % chunk == 0 and 1 <= chunk <= 256


def _check(name, g, chunk):
    if not fits(g, chunk):
        raise ValueError(f"{name} takes g [B, T, H, K] with H*K a multiple of {COLS} and T a "
                         f"multiple of chunk <= 256, got shape {g.shape}, chunk={chunk}")


def _zeros():
    return plgpu.layout_cast(jnp.zeros((COLS,), F32), VEC)


def _call(body, name, ins, n_bufs, chunk, interpret):
    """``body(*in_refs, out_ref, bufs, bar)`` over the grid (b, c, j) of the [B, T, H, K] float32
    inputs ``ins`` viewed as [B, T, H K / 128, 128]: one [B, T, H, K] float32 result."""
    B, T, H, K = ins[0].shape
    views = [x.astype(F32).reshape(B, T, H * K // COLS, COLS) for x in ins]
    scratch = dict(bufs=plgpu.SMEM((n_bufs, chunk, COLS), F32),
                   bar=plgpu.Barrier(num_arrivals=len(ins)))
    out = kernel(body, name=name, out_type=out_struct(views[0].shape, F32, *ins), scratch=scratch,
                 grid=(B, T // chunk, H * K // COLS), grid_names=GRID, interpret=interpret,
                 auto_barriers=False)(*views)
    return out.reshape(B, T, H, K)


def _tile_io(chunk, in_refs, out_ref, bufs, bar, walk):
    """Copy each input's tile into ``bufs[i]``, run ``walk()`` (which leaves the result in
    ``bufs[0]``) and send ``bufs[0]`` back."""
    b, c, j = (lax.axis_index(n) for n in GRID)
    span = pl.ds(c * chunk, chunk)
    for i, ref in enumerate(in_refs):
        plgpu.copy_gmem_to_smem(ref.at[b, span, j], bufs.at[i], bar)
    plgpu.barrier_wait(bar)
    walk()
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(bufs.at[0], out_ref.at[b, span, j])
    plgpu.wait_smem_to_gmem(0)


def decay_cumsum(g, chunk, *, interpret):
    """γ_t = Σ_{s<=t} g_s within each chunk of ``chunk`` tokens, float32 [B, T, H, K]."""
    _check("decay_scan_mosaic.decay_cumsum", g, chunk)

    def body(g_ref, out_ref, bufs, bar):
        x = bufs.at[0]

        def step(t, g_t, acc):
            acc = acc + g_t
            x.at[t][...] = acc
            return acc

        _tile_io(chunk, (g_ref,), out_ref, bufs, bar, lambda: tokens(
            lambda t: row(x.at[t]), step, _zeros(), interpret, rows=chunk))

    return _call(body, "decay_cumsum", (g,), 1, chunk, interpret)


def decay_sums_pullback(dgamma, dsigma, chunk, *, interpret):
    """dg_t = Σ_{i>=t} dγ_i + Σ_{i<t} dσ_i within each chunk, float32 [B, T, H, K]: the first
    sum by a reverse walk over dγ's tile (in place), the second added by a forward walk."""
    _check("decay_scan_mosaic.decay_sums_pullback", dgamma, chunk)
    if dsigma.shape != dgamma.shape:
        raise ValueError(f"dsigma must have dgamma's shape {dgamma.shape}, got {dsigma.shape}")

    def body(dgamma_ref, dsigma_ref, out_ref, bufs, bar):
        x, s = bufs.at[0], bufs.at[1]

        def suffix(t, dgamma_t, acc):
            acc = acc + dgamma_t
            x.at[t][...] = acc
            return acc

        def prefix(t, values, acc):
            suffix_t, dsigma_t = values
            x.at[t][...] = suffix_t + acc
            return acc + dsigma_t

        def walk():
            tokens(lambda t: row(x.at[t]), suffix, _zeros(), interpret, reverse=True,
                   rows=chunk)
            tokens(lambda t: (row(x.at[t]), row(s.at[t])), prefix, _zeros(), interpret,
                   rows=chunk)

        _tile_io(chunk, (dgamma_ref, dsigma_ref), out_ref, bufs, bar, walk)

    return _call(body, "decay_sums_pullback", (dgamma, dsigma), 2, chunk, interpret)
