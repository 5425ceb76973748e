"""``atk_precondition`` (SPEC 3.2) on Pallas kernels: layout, ``custom_vjp`` wrapper, ``supports``.

Forward: the token loop of ``atk_triton`` (one program per batch row, head and K tile, A in
registers, tokens in unrolled blocks of U). Backward (exact): one reverse token loop that
recomputes each block's A_t from the state entering the block (a [B, T/U, H, K] float32 residual
of the forward, 1/U of the A_t themselves) and emits the cotangents of k, gain, the decay
(per head or per channel), the centre and the initial state. Per-head sums over K of a K tile
and the centre's sum over batch rows and tokens are partials the kernel writes and XLA adds up
here (deterministic, no atomics).

Packed documents (``cu_seqlens``) need no chunk layout: the kernels restart A at each document's
first token. K is padded to a power of two >= 16 (keys and initial state zero: padded
channels give A = 0, k̃ = 0), T to a multiple of U (k = 0, gain = 0, g = 0: A passes unchanged).
``chunk_size`` is not used. x and ε are compiled into the kernels, so they must be concrete.

Inside a ``jit`` over a device mesh the kernel calls go through ``partition.sharded_call`` (batch
rows and heads stay sharded; with packed documents only heads). Without a GPU the kernels run in
interpret mode.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.atk_triton import AUX, CENTER, DECAY, DOC, FIRST, GAIN, LAST, atk_bwd, atk_fwd
from pallas_kernels.partition import match_types, sharded_call
from pallas_kernels.triton_common import (
    MAX_HEAD_DIM, aux_rows, doc_columns, interpret_default, pad_last, pow2_dim, vary_alike)
from precond_linattn.numerics import f32
from precond_linattn.varlen import segments


@dataclasses.dataclass(frozen=True)
class Options:
    """Kernel tuning (static): tokens per unrolled block, channels per program (a power of two
    >= 16, capped at the padded K), blocks loaded ahead, warps per program."""

    block_t: int = 16
    block_k: int = 32
    prefetch: int = 2
    num_warps: int = 1


@dataclasses.dataclass(frozen=True)
class _Config:
    hyper: tuple  # (log x, eps) as floats
    packed: bool  # documents packed along T (cu_seqlens)
    block_k: int
    options: Options
    interpret: bool


def supports(*, K: int, dtype, decay: int = 3) -> bool:
    """Whether the kernels take this call (K up to MAX_HEAD_DIM after padding; any dtype, per-head
    (``decay`` = 3 dims) or per-channel (4) decay)."""
    del dtype, decay
    return pow2_dim(K) <= MAX_HEAD_DIM


def _call(cfg, kernel, args, in_axes, out_axes):
    """``kernel(*args)`` through ``sharded_call``; None arguments (no per-channel decay) stay None."""
    o = cfg.options
    fn = functools.partial(kernel, hyper=cfg.hyper, packed=cfg.packed, block_t=o.block_t,
                           block_k=cfg.block_k, prefetch=o.prefetch, num_warps=o.num_warps,
                           interpret=cfg.interpret)
    return sharded_call(lambda *xs: tuple(fn(*xs)), args, in_axes, out_axes,
                        shard_batch=not cfg.packed)


def _forward(cfg, k, aux, g, init):
    """(k̃, final A, block-start states); g None for per-head decay (in aux)."""
    return _call(cfg, atk_fwd, [k, aux, g, init], ["b t h k", "b t h a", "b t h k", "n h k"],
                 ["b t h k", "n h k", "b s h k"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(cfg, k, aux, g, init):
    return _forward(cfg, k, aux, g, init)[:2]


def _scan_fwd(cfg, k, aux, g, init):
    k_write, final, starts = _forward(cfg, k, aux, g, init)
    return (k_write, final), (k, aux, g, init, starts)


def _scan_bwd(cfg, res, cts):
    k, aux, g, init, starts = res
    dkw, dfinal = cts
    out = _call(cfg, atk_bwd, [k, aux, g, init, starts, dkw, dfinal],
                ["b t h k", "b t h a", "b t h k", "n h k", "b s h k", "b t h k", "n h k"],
                ["b t h k", "b t h q"] + ([] if g is None else ["b t h k"]) + ["n h k"])
    dk, daux, dinit = out[0], out[1], out[-1]
    B, T, H, _ = k.shape
    daux = jnp.sum(daux.reshape(B, T, H, -1, AUX), axis=3)
    dg = None if g is None else out[2].astype(g.dtype)
    return match_types((dk.astype(k.dtype), daux, dg, dinit), (k, aux, g, init))


_scan.defvjp(_scan_fwd, _scan_bwd)


def atk_pallas(k, log_decay, gain, center, x, eps, initial_state, cu_seqlens, chunk_size,
               options: Options = Options(), interpret: bool | None = None):
    """k̃ [B, T, H, K] (k's dtype) and final A [N, H, K] (float32) on the Pallas kernels.

    Arguments as ``precond_linattn.reference.atk.atk_reference`` (log_decay [B, T, H] or
    [B, T, H, K], never None), each in its own dtype, plus the unused ``chunk_size``. Raises
    ValueError for a head dim the kernels cannot take or traced x / eps."""
    del chunk_size
    B, T, H, K = k.shape
    if not supports(K=K, dtype=k.dtype):
        raise ValueError(f"impl='pallas' takes head dims K <= {MAX_HEAD_DIM}, got K={K}; "
                         "use impl='chunked' (impl='auto' falls back to it)")
    if any(isinstance(v, jax.core.Tracer) for v in (x, eps)):
        raise ValueError("impl='pallas' compiles x and eps into the kernels: pass numbers, not "
                         "traced values (or use impl='chunked')")
    bk = options.block_k
    if bk < 16 or bk & (bk - 1) or options.block_t < 1 or options.prefetch < 1:
        raise ValueError(f"options: block_k must be a power of two >= 16 and block_t, prefetch "
                         f">= 1, got {options}")
    seg = segments(B, T, cu_seqlens)
    gain = f32(gain)
    per_head = log_decay.ndim == 3
    columns = {GAIN: gain, CENTER: f32(center)} | ({DECAY: f32(log_decay)} if per_head else {})
    aux = aux_rows(columns | doc_columns(seg, DOC, FIRST, LAST), AUX, gain)
    Kp = pow2_dim(K)
    U = options.block_t
    pad_t = [(0, 0), (0, -T % U), (0, 0), (0, 0)]
    g = None if per_head else jnp.pad(pad_last(log_decay, Kp), pad_t)
    init = (jnp.zeros((seg.num_docs, H, Kp), jnp.float32) if initial_state is None
            else pad_last(f32(initial_state), Kp))
    cfg = _Config((math.log(float(x)), float(eps)), cu_seqlens is not None,
                  min(bk, Kp), options,
                  interpret_default() if interpret is None else interpret)
    k_write, final = _scan(cfg, *vary_alike(jnp.pad(pad_last(k, Kp), pad_t), jnp.pad(aux, pad_t),
                                            g, init))
    return k_write[:, :T, :, :K], final[..., :K]
