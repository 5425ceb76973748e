"""``atk_precondition`` (SPEC 3.2) on Pallas kernels: layout, ``custom_vjp`` wrapper, ``supports``.

Forward: the token loop of ``atk_triton`` (one program per batch row, head and K tile, A in
registers, tokens in unrolled blocks of U). Backward (exact): one reverse token loop that
recomputes each block's A_t from the state entering the block (a [B, T/U, H, K] float32 residual
of the forward, 1/U of the A_t themselves) and emits the cotangents of k, gain, the decay
(per head or per channel), the centre and the initial state. Per-head sums over K of a K tile
and the centre's sum over batch rows and tokens are partials the kernel writes and XLA adds up
here (deterministic, no atomics).

Sequence pieces (``Options.sequence_pieces``, dense rows only): the recurrence is linear in the
state it carries, A_out = D ⊙ A_in + E over a piece (D the product of the piece's decays, E its
state from zero), so a row of T tokens runs as p rows of T / p (a reshape): one pass of the
recurrence alone from zero gives each piece's E, a chain of p multiply-adds in XLA the states
entering the pieces, and the full pass from those gives k̃, the block-start states and the final
state. The backward likewise: λ at a piece's start is D ⊙ λ at its end plus its own part (the
reverse recurrence alone from zero), the chain runs from the last piece down, then the full
reverse pass. p times the programs for twice the token loops: a one-warp program's token loop is
latency-bound, so few programs leave the GPU idle (RESULTS run 38 for OSGM's loops).

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

from pallas_kernels import atk_mosaic, rows_mosaic
from pallas_kernels.atk_triton import AUX, CENTER, DECAY, DOC, FIRST, GAIN, LAST, atk_bwd, atk_fwd
from pallas_kernels.partition import lowered_once, match_types, sharded_call
from pallas_kernels.token_pieces import auto_pieces, chain, rows, unrows
from pallas_kernels.triton_common import (
    MAX_HEAD_DIM, TraceDefaults, aux_rows, doc_columns, interpret_default, pad_last, pow2_dim,
    vary_alike)
from precond_linattn.numerics import f32
from precond_linattn.varlen import segments


@dataclasses.dataclass(frozen=True)
class Options:
    """Kernel tuning (static): tokens per unrolled block, channels per program (a power of two
    >= 16, capped at the padded K), blocks loaded ahead, warps per program, and the pieces each
    dense row's sequence is cut into (module docstring; None, the default: ``auto_pieces``, the
    fastest on the H200 at 8x2048x8x128 of 1, 2, 4, 8, 16: phase fwd+bwd 1.24 -> 0.81 ms at 4,
    benchmarks/RESULTS.md run 47; packed documents never split). ``mosaic``: the Mosaic GPU
    kernels of ``atk_mosaic`` (one thread a coordinate) where they run (K padded to 128,
    16-bit keys, a per-head decay), else the Triton ones; on by default since they passed the
    device checks and ran the phase 2x faster (benchmarks/RESULTS.md runs 97 and 99).
    ``mosaic_warpgroups``: 2 runs them on two warpgroups, A's chain (forward) and λ's
    (backward) on one, the squash and the gradients of neighbouring tiles on the other
    (``atk_mosaic``; off until timed on the device). ``stream``: the Mosaic kernels on that
    XLA GPU stream (``rows_mosaic.on_stream``); None (the default): on the main stream."""

    block_t: int = 16
    block_k: int = 32
    prefetch: int = 2
    num_warps: int = 1
    sequence_pieces: int | None = None
    mosaic: bool = True
    mosaic_warpgroups: int = 1
    stream: int | None = None

    def __post_init__(self):
        bk, p = self.block_k, self.sequence_pieces
        rows_mosaic.check_stream(self.stream)
        if self.mosaic_warpgroups not in (1, 2) or isinstance(self.mosaic_warpgroups, bool):
            raise ValueError(f"Options.mosaic_warpgroups must be 1 or 2, got "
                             f"{self.mosaic_warpgroups!r}")
        if bk < 16 or bk & (bk - 1) or self.block_t < 1 or self.prefetch < 1:
            raise ValueError(f"options: block_k must be a power of two >= 16 and block_t, "
                             f"prefetch >= 1, got {self}")
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < 1):
            raise ValueError(f"Options.sequence_pieces must be None or an int >= 1, got {p!r}")


_DEFAULT = TraceDefaults("default_options", Options, Options())  # of calls that name none


def default_options(options: Options | None):
    """Calls traced inside take ``options`` where they name none, as ``impl="pallas"`` /
    ``"auto"`` through the layers and models do (e.g. a training benchmark with the kernels on
    another stream); None keeps the current ones. Trace-time only: a function jitted and
    traced before keeps its kernels."""
    return _DEFAULT.use(options)


@dataclasses.dataclass(frozen=True)
class _Config:
    hyper: tuple  # (log x, eps) as floats
    packed: bool  # documents packed along T (cu_seqlens)
    block_k: int
    options: Options
    interpret: bool
    pieces: int = 1  # sequence pieces of each dense row


def supports(*, K: int, dtype, decay: int = 3) -> bool:
    """Whether the kernels take this call (K up to MAX_HEAD_DIM after padding; any dtype, per-head
    (``decay`` = 3 dims) or per-channel (4) decay)."""
    del dtype, decay
    return pow2_dim(K) <= MAX_HEAD_DIM


def _call(cfg, kernel, args, in_axes, out_axes, emit=True):
    """``kernel(*args)`` through ``sharded_call``; None arguments (no per-channel decay) stay None."""
    o = cfg.options
    fn = functools.partial(kernel, hyper=cfg.hyper, packed=cfg.packed, block_t=o.block_t,
                           block_k=cfg.block_k, prefetch=o.prefetch, num_warps=o.num_warps,
                           interpret=cfg.interpret, emit=emit)
    return sharded_call(lambda *xs: tuple(fn(*xs)), args, in_axes, out_axes,
                        shard_batch=not cfg.packed)


def _piece_decay(aux, g, p):
    """D [B, p, H, K or 1]: the product of each piece's decays, exp of the summed log decay."""
    log_decay = aux[..., DECAY, None] if g is None else g
    B, T = log_decay.shape[:2]
    return jnp.exp(jnp.sum(log_decay.reshape(B, p, T // p, *log_decay.shape[2:]), axis=2))


def _chain(D, E, start, reverse=False):
    """States entering each piece [B, p, H, K]: S_0 = start, S_{i+1} = D_i S_i + E_i (reverse:
    from the last piece down, S_{p−1} = start, S_{i−1} = D_i S_i + E_i)."""
    return chain(lambda S, m: m[0] * S + m[1], (D, E), start, reverse)


_FWD_IN = ["b t h k", "b t h a", "b t h k", "n h k"]


def _forward(cfg, k, aux, g, init):
    """(k̃, final A, block-start states); g None for per-head decay (in aux)."""
    p = cfg.pieces
    if p == 1:
        return _call(cfg, atk_fwd, [k, aux, g, init], _FWD_IN, ["b t h k", "n h k", "b s h k"])
    B, _, H, K = k.shape
    pk, paux, pg = rows(k, p), rows(aux, p), rows(g, p)
    (E,) = _call(cfg, atk_fwd, [pk, paux, pg, jnp.zeros((B * p, H, K), jnp.float32)], _FWD_IN,
                 ["n h k"], emit=False)
    entering = _chain(_piece_decay(aux, g, p), E.reshape(B, p, H, K), init)
    k_write, finals, starts = _call(cfg, atk_fwd, [pk, paux, pg, entering.reshape(B * p, H, K)],
                                    _FWD_IN, ["b t h k", "n h k", "b s h k"])
    return unrows(k_write, p), finals.reshape(B, p, H, K)[:, -1], unrows(starts, p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(cfg, k, aux, g, init):
    return _forward(cfg, k, aux, g, init)[:2]


def _scan_fwd(cfg, k, aux, g, init):
    k_write, final, starts = _forward(cfg, k, aux, g, init)
    return (k_write, final), (k, aux, g, init, starts)


_BWD_IN = ["b t h k", "b t h a", "b t h k", "n h k", "b s h k", "b t h k", "n h k"]


def _backward(cfg, k, aux, g, init, starts, dkw, dfinal):
    """atk_bwd's outputs (dk, daux, [dg], dinit), over sequence pieces when ``cfg.pieces`` > 1."""
    out_axes = ["b t h k", "b t h q"] + ([] if g is None else ["b t h k"]) + ["n h k"]
    p = cfg.pieces
    if p == 1:
        return _call(cfg, atk_bwd, [k, aux, g, init, starts, dkw, dfinal], _BWD_IN, out_axes)
    B, _, H, K = k.shape
    pieces = [rows(x, p) for x in (k, aux, g)]
    zeros = jnp.zeros((B * p, H, K), jnp.float32)  # the initial-state slot (unused: dense rows)
    rest = [rows(starts, p), rows(dkw, p)]
    (own,) = _call(cfg, atk_bwd, pieces + [zeros] + rest + [zeros], _BWD_IN, ["n h k"],
                   emit=False)
    leaving = _chain(_piece_decay(aux, g, p), own.reshape(B, p, H, K), dfinal, reverse=True)
    out = _call(cfg, atk_bwd, pieces + [zeros] + rest + [leaving.reshape(B * p, H, K)], _BWD_IN,
                out_axes)
    return [unrows(x, p) for x in out[:-1]] + [out[-1].reshape(B, p, H, K)[:, 0]]


def _scan_bwd(cfg, res, cts):
    k, aux, g, init, starts = res
    out = _backward(cfg, k, aux, g, init, starts, *cts)
    dk, daux, dinit = out[0], out[1], out[-1]
    B, T, H, _ = k.shape
    daux = jnp.sum(daux.reshape(B, T, H, -1, AUX), axis=3)
    dg = None if g is None else out[2]
    return match_types((dk, daux, dg, dinit), (k, aux, g, init))


_scan.defvjp(_scan_fwd, _scan_bwd)
_scan = lowered_once(_scan)


def _mosaic_call(cfg, kernel, args, in_axes, out_axes):
    """A kernel of ``atk_mosaic`` through ``rows_mosaic.call``."""
    fn = functools.partial(kernel, hyper=cfg.hyper, interpret=cfg.interpret, packed=cfg.packed,
                           warpgroups=cfg.options.mosaic_warpgroups)
    return rows_mosaic.call(fn, args, in_axes, out_axes, packed=cfg.packed,
                            interpret=cfg.interpret, stream=cfg.options.stream)


def _mosaic_rows(cfg, aux, Tp):
    """``atk_mosaic.coefficient_rows`` from the aux rows (gain, log decay, centre, documents)."""
    docs = tuple(aux[:, :, 0, c] for c in (DOC, FIRST, LAST)) if cfg.packed else None
    return atk_mosaic.coefficient_rows(aux[..., GAIN], aux[..., DECAY], aux[..., CENTER], Tp, docs)


def _mosaic_forward(cfg, k, aux, init, residuals=False):
    """``atk_mosaic.atk_fwd``'s (k̃, final A[, the states entering the tiles]), T padded to
    whole tiles and k̃ cut back."""
    T = k.shape[1]
    Tp = rows_mosaic.padded_length(T)
    out = _mosaic_call(cfg, functools.partial(atk_mosaic.atk_fwd, residuals=residuals),
                       [rows_mosaic.tile_padded(k, Tp), _mosaic_rows(cfg, aux, Tp), init],
                       ["b t h k", "b h r t", "n h k"],
                       ["b t h k", "n h k"] + (["b i h k"] if residuals else []))
    return (out[0][:, :T], *out[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mosaic_scan(cfg, k, aux, init):
    return _mosaic_forward(cfg, k, aux, init)


def _mosaic_scan_fwd(cfg, k, aux, init):
    k_write, final, starts = _mosaic_forward(cfg, k, aux, init, residuals=True)
    return (k_write, final), (k, aux, init, starts)


def _mosaic_scan_bwd(cfg, res, cts):
    k, aux, init, starts = res
    dkw, dfinal = cts
    T = k.shape[1]
    Tp = rows_mosaic.padded_length(T)
    dk, rows, dinit = _mosaic_call(
        cfg, atk_mosaic.atk_bwd,
        [rows_mosaic.tile_padded(k, Tp), rows_mosaic.tile_padded(dkw.astype(k.dtype), Tp),
         _mosaic_rows(cfg, aux, Tp), starts, init, dfinal],
        ["b t h k", "b t h k", "b h r t", "b i h k", "n h k", "n h k"],
        ["b t h k", "b h j t", "n h k"])
    dgain, dcenter, ddecay = rows_mosaic.token_rows(rows, T)
    daux = jnp.zeros_like(aux).at[..., GAIN].set(dgain).at[..., CENTER].set(dcenter)
    daux = daux.at[..., DECAY].set(ddecay)
    return match_types((dk[:, :T], daux, dinit), (k, aux, init))


_mosaic_scan.defvjp(_mosaic_scan_fwd, _mosaic_scan_bwd)
_mosaic_scan = lowered_once(_mosaic_scan)


def atk_pallas(k, log_decay, gain, center, x, eps, initial_state, cu_seqlens, chunk_size,
               options: Options | None = None, interpret: bool | None = None):
    """k̃ [B, T, H, K] (k's dtype) and final A [N, H, K] (float32) on the Pallas kernels.

    Arguments as ``precond_linattn.reference.atk.atk_reference`` (log_decay [B, T, H] or
    [B, T, H, K], never None), each in its own dtype, plus the unused ``chunk_size``;
    ``options`` None: those of ``default_options`` (else Options()). Raises ValueError for a
    head dim the kernels cannot take or traced x / eps."""
    del chunk_size
    options = _DEFAULT.current if options is None else options
    B, T, H, K = k.shape
    if not supports(K=K, dtype=k.dtype):
        raise ValueError(f"impl='pallas' takes head dims K <= {MAX_HEAD_DIM}, got K={K}; "
                         "use impl='chunked' (impl='auto' falls back to it)")
    if any(isinstance(v, jax.core.Tracer) for v in (x, eps)):
        raise ValueError("impl='pallas' compiles x and eps into the kernels: pass numbers, not "
                         "traced values (or use impl='chunked')")
    seg = segments(B, T, cu_seqlens)
    gain = f32(gain)
    per_head = log_decay.ndim == 3
    columns = {GAIN: gain, CENTER: f32(center)} | ({DECAY: f32(log_decay)} if per_head else {})
    aux = aux_rows(columns | doc_columns(seg, DOC, FIRST, LAST), AUX, gain)
    Kp = pow2_dim(K)
    init = (jnp.zeros((seg.num_docs, H, Kp), jnp.float32) if initial_state is None
            else pad_last(f32(initial_state), Kp))
    hyper = (math.log(float(x)), float(eps))
    interpret = interpret_default() if interpret is None else interpret
    if options.mosaic and atk_mosaic.runs(K=Kp, dtype=k.dtype, per_head=per_head):
        cfg = _Config(hyper, cu_seqlens is not None, Kp, options, interpret)
        k_write, final = _mosaic_scan(cfg, *vary_alike(pad_last(k, Kp), aux, init))
        return k_write[..., :K], final[..., :K]
    bk = min(options.block_k, Kp)
    pieces = 1 if cu_seqlens is not None else options.sequence_pieces or auto_pieces(
        programs=B * H * (Kp // bk), T=T)
    U = options.block_t * pieces  # T padded to whole blocks in every piece
    pad_t = [(0, 0), (0, -T % U), (0, 0), (0, 0)]
    g = None if per_head else jnp.pad(pad_last(log_decay, Kp), pad_t)
    cfg = _Config(hyper, cu_seqlens is not None, bk, options, interpret, pieces)
    k_write, final = _scan(cfg, *vary_alike(jnp.pad(pad_last(k, Kp), pad_t), jnp.pad(aux, pad_t),
                                            g, init))
    return k_write[:, :T, :, :K], final[..., :K]
