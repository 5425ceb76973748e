"""``delta_rule`` on Pallas kernels: layout, ``custom_vjp`` wrapper, ``supports``.

Two pipelines, both exact (``Options.split`` picks; the split one is the default):

split (``state_fwd_triton``, ``state_bwd_triton``): the per-chunk tensors of the WY form (SPEC
2.1), W = (I + L)^-1 Diag(β)(K ⊙ Γ), U = (I + L)^-1 Diag(β) V, K̃ ⊙ Γ_C/Γ, Q ⊙ Γ, P and Γ_C,
come from the chunk-parallel kernel ``wy_triton.wy_fwd`` (no decay, scalar decay), and with a
per-channel decay from ``prepare`` in plain JAX or ``wy_vector_triton.wy_vector_fwd``
(``Options.vector_wy``); a serial kernel carries the state through the chunks with 2 matmuls
per chunk (Triton, or by default on a GPU with 16-bit inputs Mosaic GPU: ``state_mosaic``, which
also forms the outputs; ``Options.serial_backend``) and chunk-parallel kernels form the outputs.
The backward reuses the forward's WY
tensors (``Options.save_wy``) or recomputes them, runs the reverse state pass the same way (2
matmuls per chunk) and the per-chunk cotangents in parallel, then the pullback of the WY step
(``wy_bwd`` / ``wy_vector_bwd``, reading T = (I + L)^-1 from the forward, or ``prepare``'s
``jax.vjp``).

fused (``delta_fwd_triton``, ``delta_bwd_triton``): one kernel per direction does all the
per-chunk work inside its serial chunk loop (the WY tensors are still recomputed outside for the
backward). Kept as the measured baseline (benchmarks/NOTES.md).

Both invert (I + L) by block merges (``triton_common.unit_lower_inverse``: matmuls on tensor
cores, at the kernels' precision), not ``chunk_wy``'s triangular solve, whose batched GPU form
and transpose were slow; ``prepare`` is also the kernels' test oracle.

Packed documents (``cu_seqlens``) use the document-aligned chunk layout of
``precond_linattn.varlen``; head dims are zero-padded to a power of two >= 16 (exact: padded key
channels and value columns stay zero). Without a GPU the same kernels run in interpret mode.

Inside a ``jit`` over a device mesh all kernel calls go through ``partition.sharded_call``: they
run per device on the shards of the batch and head axes the inputs carry (the plain-JAX steps
around them are partitioned by XLA), so nothing is all-gathered to feed a kernel. With packed
documents (one batch row) only heads are split. Dense batches index the states [N = B, ...] by
document ids relative to the shard's first row, so a shard of rows is a call of its own.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.delta_bwd_triton import delta_bwd
from pallas_kernels.grads_mosaic import chunk_grads_fused
from pallas_kernels.delta_fwd_triton import delta_fwd
from pallas_kernels import (decay_scan_mosaic, grads_mosaic, inverse_mosaic, sequence_split,
                            state_mosaic, state_wy_mosaic, wy_vector_mosaic,
                            wy_vector_pullback_mosaic)
from pallas_kernels.partition import lowered_once, match_types, sharded_call
from pallas_kernels.state_bwd_triton import dout_products, split_backward
from pallas_kernels.state_fwd_triton import split_forward
from pallas_kernels.triton_common import (
    MAX_HEAD_DIM, Dots, TraceDefaults, interpret_default, pad_last, pow2_dim, unit_lower_inverse,
    vary_alike)
from pallas_kernels.wy_triton import wy_bwd, wy_fwd, wy_inverse
from pallas_kernels.wy_vector_triton import wy_vector_bwd, wy_vector_fwd
from precond_linattn.chunked.delta import chunk_grams, chunk_wy, decay_sums
from precond_linattn.numerics import f32
from precond_linattn.varlen import chunk_layout, from_chunks, to_chunks



@dataclasses.dataclass(frozen=True)
class Options:
    """Kernel tuning (static). ``split``: run the chunk recurrence as the split kernels (serial
    state passes with 2 matmuls per chunk, everything else chunk-parallel) rather than the fused
    ones (all per-chunk work inside the serial loop). ``save_wy``: the backward reuses the
    forward's WY tensors (W, U, K̃', Q', P, Γ_C, T: ~5 float32 [B, H, T, 128] arrays more
    residual memory) instead of recomputing them. ``precision``: that of float32 dots on
    tensor cores ("tf32", "tf32x3", "ieee"); None picks "tf32" when q, k, k̃ and v are all
    16-bit and "tf32x3" (about fp32) otherwise: see benchmarks/NOTES.md for the errors measured with each.
    ``vector_wy``: with a per-channel decay, the split pipeline's WY tensors and their pullback
    come from ``prepare`` and its ``jax.vjp`` in plain JAX ("xla") or from the chunk-parallel
    kernels of ``wy_vector_triton`` ("kernel": KDA fwd+bwd 11.9 -> 7.4 ms and 3.2 -> 0.7 GiB,
    RESULTS run 19; then ``save_wy`` applies too; "halving": those kernels with every key tile
    by halving down to single rows, never a factored block: an ablation for measuring, exact;
    "mosaic": the forward by ``wy_vector_mosaic`` on the tensor cores, the pullback by
    ``wy_vector_pullback_mosaic`` or by the "kernel" one (``vector_pullback`` "mosaic" or
    "kernel"; None: "mosaic" with the Mosaic forward, KDA f+b 1.999 -> 1.797 ms, RESULTS run
    148): bf16 inputs, chunk 64, padded K and V in {64, 128}, bf16 WY tensors, split;
    None: "mosaic" compiled on a Hopper GPU where it takes the call, ``precision`` is None and
    no option clashes (KDA fwd / fwd+bwd 0.659 / 2.185 -> 0.444 / 1.975 ms, PKDA 0.740 / 2.443
    -> 0.563 / 2.211 at 8x2048x8x128, RESULTS runs 138, 140), else "kernel").
    ``parallel_precision``: that of the dots in the split pipeline's chunk-parallel kernels whose
    results do not feed the state recurrence (outputs, dO products, per-chunk cotangents, the WY
    pullback); None picks "bf16" when ``precision`` is None and q, k, k̃, v are all 16-bit
    (as FLA's kernels do; errors within FLA's bars, benchmarks/NOTES.md v6), else ``precision``.
    "bf16" halves those kernels' operand registers and doubles the tensor-core rate; the serial
    passes and the WY forward, whose rounding would compound along the sequence, keep
    ``precision``. ``wy_dtype``: that of W, U, K̃', Q' and P between the WY step and the
    recurrence kernels (T, Γ_C and every cotangent stay float32); "bfloat16" (as FLA stores w
    and u; what the Mosaic passes take) is within FLA's bars on CPU and, with those passes, on the
    H200 (RESULTS runs 28-30); None: "bfloat16" with the Mosaic passes, else "float32".
    ``serial_precision``: that of the split pipeline's two serial state passes (None: as
    ``precision``); "bf16" rounds the state and R to bf16 at their dots, as FLA and
    jax-linear-attention do (and the Mosaic passes always).
    ``state_dtype``: that of the per-chunk states, R, dR and dO products kept in
    HBM between kernels (the serial carries stay float32); None picks "bfloat16" under the same
    rule as ``parallel_precision`` (as FLA stores its states; DeltaNet fwd+bwd -20 %, errors
    unchanged, RESULTS run 19), else "float32". ``serial_backend``: the split pipeline's two
    serial state passes as Pallas Triton kernels ("triton") or as Mosaic GPU kernels
    (``state_mosaic``: wgmma with the carry in registers, TMA double buffering; "mosaic"
    takes 16-bit q, k, k̃, v, chunk 64, padded K 64 or 128, and implies wy_dtype and
    state_dtype "bfloat16" and serial_precision "bf16"; ValueError otherwise, and where an
    explicit option contradicts that). None picks "mosaic" on a Hopper GPU where it runs and the
    options leave those settings open, else "triton" (always in interpret mode: the CPU tests
    of the defaults exercise the Triton passes; ``state_mosaic``'s own tests the other).
    ``output_in_serial``: the outputs formed in the forward state pass instead of by the output
    kernel (None: with the Mosaic passes, as jax-linear-attention does; not with the Triton
    ones, where run 19 measured it no faster). ``dout_in_serial``: the backward state pass forms
    the dO products itself (the Triton pass both, measured no faster in run 19; the Mosaic pass
    G = scale Q'ᵀ dO as a third wgmma a chunk, so G never goes through HBM: fwd+bwd -3 % / -6 %
    for DeltaNet / GDN in run 31); None: with the Mosaic passes, not with the Triton ones.
    ``serial_block_v``: exact but measured no faster (run 19): off. ``pullback_warps``: the WY
    pullback kernel's own warps; None: 8 with a scalar decay (GDN's pullback 0.99 against 1.26
    ms at 4 in run 15, fwd+bwd 1.85 against 2.01 in run 31) and a vector one (below), else
    ``num_warps`` (DeltaNet's pullback 0.93 against 0.72 ms at 8 in run 15, fwd+bwd 2.15 against
    1.40 in run 31). ``wy_warps``: the WY forward kernel's own warps; None: 8 with a vector decay,
    else ``num_warps`` (the per-channel-decay WY kernels hold more than 255 registers a thread at
    4 warps and spill; 8 warps for both of them: KDA fwd+bwd 3.98 -> 3.48 ms with mild gates,
    7.17 -> 6.01 with the layers' gates, runs 44-45, benchmarks/NOTES.md v8.3).
    ``wy_block_k``: the WY kernels' own key tile (None: ``block_k``, which chunk_grads uses too;
    at 32 the per-channel WY forward holds no spilled registers at 8 warps, benchmarks/NOTES.md
    v8.4). ``sequence_pieces``: the Mosaic serial passes over the sequence cut into that many pieces run
    in parallel (``sequence_split``: an extra pass with K more value columns and a chain of p
    small products buy p times the programs; dense rows, the chunks a multiple of it); None:
    ``sequence_split.auto_pieces`` with the Mosaic passes over dense rows (more than 1 only where
    B H V / 64 CTAs leave most SMs idle, e.g. B = 1), else 1. ``fused_grads``: with the Mosaic
    passes, no or a scalar decay, bf16 inputs, chunks of 64 and padded K, V in {64, 128}, the
    backward's per-chunk cotangents and the WY pullback as one Mosaic GPU kernel
    (``grads_mosaic``: no dW, dK̃', dQ', dP through HBM) instead of ``chunk_grads`` then
    ``wy_bwd`` (GDN fwd+bwd 1.23 -> 0.82 ms, DeltaNet 0.92 -> 0.78 at 8x2048x8x128, RESULTS run
    69); None: on wherever it applies, True: ValueError where it does not, False: off.
    ``grads_warpgroups``: ``grads_mosaic``'s two
    chains (X, dV, the inverse, dK; dP, dQ, dK̃) in one warpgroup or in two (the default: each
    with its own registers; the kernel 280 -> 184 µs, DeltaNet / GDN fwd+bwd 0.80 / 0.82 ->
    0.66 / 0.68-0.71 ms, RESULTS run 76). ``wy_precision``: the no / scalar-decay WY forward's
    dots (the grams, P, the inverse; None: ``precision``); ``wy_apply_precision``: its W and U
    dots (None: "bf16" with the Mosaic passes, which store W and U in bf16 (T rounded to bf16
    first, as FLA's ``recompute_w_u`` reads it: ``wy_fwd`` 235 -> 206 µs, errors within the
    bars with similar keys too, RESULTS run 78), else as ``wy_precision``); the
    per-channel-decay kernels ignore both. ``wy_in_serial``: with ``fused_grads`` and one
    sequence piece, the WY step stores only T, P and Γ_C (``wy_triton.wy_inverse``) and the
    state passes apply T and the per-row scalings themselves (``state_wy_mosaic``: no W, U, K̃',
    Q' through HBM, where the WY forward spent half its time writing them, RESULTS run 78:
    DeltaNet / GDN forwards 0.261 / 0.281 -> 0.212 / 0.229 ms, fwd+bwd 0.622 / 0.651 -> 0.549 /
    0.579, run 79); None: on wherever it applies, True: ValueError where it does not, False:
    off. ``inverse_backend``: with ``wy_in_serial``, T and P from the Triton kernel
    (``wy_triton.wy_inverse``, tf32 merges) or from ``inverse_mosaic`` (bf16 wgmmas,
    ``inverse_passes`` a merge product); None: "mosaic" with
    ``wy_in_serial`` (forwards -2 % / -5 %, fwd+bwd -3 % / -5 % for DeltaNet / GDN in run 81,
    one call: near the run-to-run noise, but all four in one direction), else "triton";
    "mosaic" without ``wy_in_serial``: ValueError. ``inverse_passes``: that Mosaic inverse's
    bf16 wgmmas a merge product (``inverse_mosaic.unit_lower_inverse``): 3 (hi / lo splits of
    both factors), 2 (L's side split; None: the default: DeltaNet / GDN forwards 0.177 / 0.180
    -> 0.148 / 0.150 ms at 8x2048x8x128 in RESULTS run 154, the bf16 errors unchanged, keys
    sharing a direction included) or 1 (jax-linear-attention's choice: faster still, but past
    FLA's bars with keys sharing a direction, run 153); the per-channel Mosaic forward
    (``vector_wy="mosaic"``) takes it too, None: 3 there (fewer not yet timed or checked on
    the device). ``p_in_serial``: with the Mosaic inverse, P = (Q K̃ᵀ) ⊙ D formed by the
    state passes, which load q and k̃ anyway, instead of by the inverse (no q load, no P store
    or load, and the backward's A = scale Pᵀ dO formed in its state pass: no ``dout_products``
    kernel, no A through HBM: DeltaNet / GDN f+b -5 % / -7 %, RESULTS run 158); None: on with
    the Mosaic inverse, True: ValueError elsewhere, False: off. ``forward_warpgroups``: with
    ``p_in_serial``, the forward state pass in one warpgroup or two (the chain and the output
    side by side, ``state_wy_mosaic.state_fwd``); None: two where the pass stores the states
    for a backward pass (96 -> 86 µs, DeltaNet / GDN f+b -2 to -5 %, RESULTS runs 160-161),
    one where it does not (84 µs either way: the chain alone sets its pace). ``decay_scan``: with a
    per-channel decay, its in-chunk sums γ (forward) and their pullback to g (backward) as XLA's
    batched 0/1-mask matmuls ("xla") or as ``decay_scan_mosaic``'s kernels ("mosaic": one thread
    a channel walking the chunk; H K a multiple of 128, ValueError otherwise); None: "mosaic"
    compiled on a Hopper GPU where it fits (KDA fwd / fwd+bwd 0.767 / 3.017 -> 0.700 / 2.809 ms
    at 8x2048x8x128, RESULTS run 128), else "xla" (so in interpret mode: the kernels' own tests
    run them there). Other decays sum in their kernels and ignore it."""

    precision: str | None = None
    parallel_precision: str | None = None
    block_v: int = 64
    block_k: int = 64  # key columns per tile of the chunk-parallel WY kernels and chunk_grads
    wy_block_k: int | None = None  # split: the WY kernels' own key tile (None: block_k)
    serial_block_v: int | None = None  # the serial state passes' V tile (None: block_v)
    state_dtype: str | None = None  # split: per-chunk states, R, dR, dO products kept in HBM
    wy_dtype: str | None = None  # split: W, U, K̃', Q', P kept in HBM (None: see above)
    serial_precision: str | None = None  # split: the serial state passes' dots (None: precision)
    output_in_serial: bool | None = None  # split: outputs formed in the forward state pass
    dout_in_serial: bool | None = None  # split: dO products formed in the backward state pass
    num_warps: int = 4
    pullback_warps: int | None = None  # split: the WY pullback kernel's warps (None: see above)
    wy_warps: int | None = None  # split: the WY forward kernel's warps (None: num_warps)
    num_stages: int = 2  # software pipelining of the serial loops' loads (RESULTS run 13)
    split: bool = True  # the split kernels (state_*_triton) instead of the fused delta_fwd/bwd
    save_wy: bool = True  # split: keep the WY tensors for the backward (not with vector_wy="xla")
    vector_wy: str | None = None  # "kernel" | "halving" | "xla" | "mosaic": the per-channel WY
    serial_backend: str | None = None  # split: "triton" | "mosaic" serial state passes
    sequence_pieces: int | None = None  # mosaic: the serial passes over pieces run in parallel
    fused_grads: bool | None = None  # mosaic: the backward's chunk cotangents and WY pullback fused
    grads_warpgroups: int = 2  # fused_grads: the kernel's two chains in 1 or 2 warpgroups
    wy_precision: str | None = None  # split: the scalar / no-decay WY forward's dots
    wy_in_serial: bool | None = None  # fused_grads: the state passes apply T (no W, U, K̃', Q')
    inverse_backend: str | None = None  # wy_in_serial: "triton" | "mosaic" wy_inverse
    inverse_passes: int | None = None  # the Mosaic inverses' bf16 wgmmas a merge product
    p_in_serial: bool | None = None  # inverse_backend="mosaic": P formed in the state passes
    forward_warpgroups: int | None = None  # p_in_serial: 2, the output beside the chain
    wy_apply_precision: str | None = None  # split: that forward's W and U dots
    decay_scan: str | None = None  # per-channel decay: "xla" | "mosaic" in-chunk sums of g
    vector_pullback: str | None = None  # vector_wy="mosaic": its pullback, "kernel" | "mosaic"

    def __post_init__(self):
        if self.vector_pullback not in (None, "kernel", "mosaic"):
            raise ValueError("Options.vector_pullback must be None, 'kernel' or 'mosaic', got "
                             f"{self.vector_pullback!r}")
        if self.decay_scan not in (None, "xla", "mosaic"):
            raise ValueError("Options.decay_scan must be None, 'xla' or 'mosaic', got "
                             f"{self.decay_scan!r}")
        if self.p_in_serial is not None and not isinstance(self.p_in_serial, bool):
            raise ValueError(f"Options.p_in_serial must be None, True or False, got "
                             f"{self.p_in_serial!r}")
        if self.forward_warpgroups not in (None, 1, 2):
            raise ValueError(f"Options.forward_warpgroups must be None, 1 or 2, got "
                             f"{self.forward_warpgroups!r}")
        if self.inverse_passes not in (None, 1, 2, 3):
            raise ValueError("Options.inverse_passes must be None, 1, 2 or 3, got "
                             f"{self.inverse_passes!r}")
        if self.inverse_backend not in (None, "triton", "mosaic"):
            raise ValueError("Options.inverse_backend must be None, 'triton' or 'mosaic', got "
                             f"{self.inverse_backend!r}")
        if self.grads_warpgroups not in (1, 2):
            raise ValueError(f"Options.grads_warpgroups must be 1 or 2, got "
                             f"{self.grads_warpgroups!r}")
        tiles = dict(block_v=self.block_v, block_k=self.block_k)
        tiles |= {n: getattr(self, n) for n in ("wy_block_k", "serial_block_v")
                  if getattr(self, n) is not None}  # None: the tile above
        for name, n in tiles.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 16 or n & (n - 1):
                raise ValueError(f"Options.{name} must be a power of two >= 16 (tiles cover the "
                                 f"padded head dims), got {n!r}")
        if self.vector_wy not in (None, "xla", "kernel", "halving", "mosaic"):
            raise ValueError("Options.vector_wy must be None, 'xla', 'kernel', 'halving' or "
                             f"'mosaic', got {self.vector_wy!r}")
        if self.state_dtype not in (None, "float32", "bfloat16"):
            raise ValueError("Options.state_dtype must be None, 'float32' or 'bfloat16', got "
                             f"{self.state_dtype!r}")
        for p in (self.serial_precision, self.wy_precision, self.wy_apply_precision):
            if p is not None:
                Dots(p)  # ValueError naming the valid ones
        if self.wy_dtype not in (None, "float32", "bfloat16"):
            raise ValueError("Options.wy_dtype must be None, 'float32' or 'bfloat16', got "
                             f"{self.wy_dtype!r}")
        if self.serial_backend not in (None, "triton", "mosaic"):
            raise ValueError("Options.serial_backend must be None, 'triton' or 'mosaic', got "
                             f"{self.serial_backend!r}")
        if self.sequence_pieces is not None and (self.sequence_pieces < 1 or
                                                 self.sequence_pieces & (self.sequence_pieces - 1)):
            raise ValueError("Options.sequence_pieces must be None or a power of two >= 1, got "
                             f"{self.sequence_pieces!r}")
        if self.serial_backend == "mosaic" and self.mosaic_clashes():
            raise ValueError(f"Options.serial_backend='mosaic' does not combine with the values "
                             f"given for {self.mosaic_clashes()} (it runs split, bf16 serial "
                             "passes over bf16 tensors, 64-wide V tiles)")

    def mosaic_clashes(self) -> list[str]:
        """The options whose given values the Mosaic serial passes cannot honour."""
        clashes = dict(split=not self.split, serial_block_v=self.serial_block_v not in (None, 64),
                       wy_dtype=self.wy_dtype == "float32",
                       state_dtype=self.state_dtype == "float32",
                       serial_precision=self.serial_precision not in (None, "bf16"))
        return [name for name, clash in clashes.items() if clash]


@dataclasses.dataclass(frozen=True)
class _Config:
    chunk: int
    decay: str  # "none" | "scalar" | "vector"
    scale: float
    num_docs: int | None  # documents packed along T (cu_seqlens); None: one per batch row
    options: Options
    dots: Dots
    pdots: Dots  # the chunk-parallel kernels' dots (Options.parallel_precision)

    @property
    def sdots(self) -> Dots:
        """The recurrence kernels' dots: the split pipeline's serial passes take
        ``Options.serial_precision`` when set; otherwise (and the fused kernels) ``dots``."""
        p = self.options.serial_precision
        return self.dots if p is None or not self.options.split else Dots(p, self.dots.interpret)


_DEFAULT = TraceDefaults("default_options", Options, Options())  # of calls that name none


def default_options(options: Options | None):
    """Calls traced inside take ``options`` where they name none, as ``impl="pallas"`` /
    ``"auto"`` through the public op, the layers and models do (e.g. ``Options(vector_wy=
    "mosaic")`` for a KDA model); None keeps the current ones. Trace-time only: a function
    jitted and traced before keeps its kernels."""
    return _DEFAULT.use(options)


def supports(*, K: int, V: int, dtype, decay) -> bool:
    """Whether the kernels take this call (any V; K up to MAX_HEAD_DIM after padding)."""
    del V, dtype, decay  # every V is tiled, every supported dtype and decay is handled
    return pow2_dim(K) <= MAX_HEAD_DIM


def _chunk_view(x, chunk):
    """Kernel layout [B, Tp, H, ...] -> [B, H, NC, C, ...] float32."""
    B, Tp = x.shape[:2]
    y = x.reshape(B, Tp // chunk, chunk, *x.shape[2:])
    return jnp.moveaxis(y, 3, 1).astype(jnp.float32)


def _flat(x):
    """[B, H, NC, C, D] -> [B, H, NC·C, D]."""
    return x.reshape(*x.shape[:2], -1, x.shape[-1])


def _views(cfg, *xs):
    """Chunk views of the inputs (None stays None): each input is cast to float32 once."""
    return [None if x is None else _chunk_view(x, cfg.chunk) for x in xs]


def prepare(cfg, q, k, kw, v, beta, g):
    """Per-chunk WY tensors for the backward kernel, in its layout (see module docstring), from
    the log decays g (None: no decay) through their in-chunk sums γ and σ (``decay_sums``).

    Returns W, U, K̃ ⊙ exp σ, Q ⊙ Γ [B, H, Tp, ·], P [B, H, Tp, C], Γ_C [B, H, NC, K]."""
    return prepare_sums(cfg, q, k, kw, v, beta,
                        *((None, None) if g is None else _decay_sums(cfg, g)))


def prepare_sums(cfg, q, k, kw, v, beta, gamma, sigma):
    """``prepare`` from the in-chunk sums γ and σ of the log decays (the kernels' layout
    [B, Tp, H(, K)]; None without a decay): the per-channel WY kernels' oracle, which take γ
    and form σ as γ_C − γ."""
    qc, kc, kwc, vc, bc, gamma, sigma = _views(cfg, q, k, kw, v, beta, gamma, sigma)
    W, U, kw_tail, q_dec, P, Gam_C = chunk_wy(
        qc, kc, kwc, vc, bc, gamma, sigma,
        solve=lambda L, rhs: cfg.dots.nn(unit_lower_inverse(L, cfg.dots), rhs))
    GC = jnp.broadcast_to(Gam_C[..., 0], kc.shape[:3] + kc.shape[-1:])
    return _flat(W), _flat(U), _flat(kw_tail), _flat(q_dec), _flat(P), GC


def _kernel_call(cfg, kernel, args: dict, axes: dict, out_axes, *, mosaic=False, **static):
    """``kernel(**args, **static)`` through ``sharded_call`` (None arguments stay None); ``axes``
    names each argument's dimensions. ``mosaic``: the call runs Mosaic GPU kernels, which in
    interpret mode run unpartitioned (``sharded_call``'s ``direct``)."""
    names, packed = list(args), cfg.num_docs is not None

    def call(*xs):
        given = dict(zip(names, xs))
        if not packed and given.get("doc") is not None:  # row b is document b: ids per shard
            given["doc"] = given["doc"] - given["doc"][:1, :1]
        return tuple(kernel(**given, **static))

    return sharded_call(call, list(args.values()), [axes[n] for n in names], out_axes,
                        shard_batch=not packed, direct=mosaic and cfg.dots.interpret)


_FLAGS = {"doc": "b c", "first": "b c", "last": "b c"}


_WY_IN = dict(q="b t h k", k="b t h k", kw="b t h k", v="b t h v", beta="b t h", g="b t h")
_WY_OUT = dict(dW="b h t k", dU="b h t v", dkw_t="b h t k", dq_dec="b h t k", dP="b h t s",
               dgc="b h c k")  # wy_fwd's outputs, named as wy_bwd's cotangent arguments
_WY_T = dict(T="b h t s")  # wy_fwd's last output, wy_bwd's argument after the inputs
_WY_VECTOR_IN = {**{n: a for n, a in _WY_IN.items() if n != "g"},
                 "gamma": "b t h k"}  # the per-channel kernels' inputs: γ for g


def _wy_kernels(cfg):
    """The WY step's (forward, pullback) kernels for ``cfg.decay``."""
    return (wy_vector_fwd, wy_vector_bwd) if cfg.decay == "vector" else (wy_fwd, wy_bwd)


def _xla_wy(cfg):
    """Whether the WY step runs as ``prepare`` in plain JAX (per-channel decay,
    ``vector_wy="xla"``), not as kernels."""
    return cfg.decay == "vector" and cfg.options.vector_wy == "xla"


def _log_decay_grads(cfg, g, dgamma, dsigma):
    """dg [B, Tp, H, K] from the per-channel WY pullback's dγ and dσ: the pullback of
    ``_decay_sums`` (XLA, or ``decay_scan_mosaic``'s kernel: ``Options.decay_scan``)."""
    if cfg.options.decay_scan == "mosaic":
        axes = dict(dgamma="b t h k", dsigma="b t h k")
        return _kernel_call(cfg, _scan_pullback, dict(dgamma=dgamma, dsigma=dsigma), axes,
                            ("b t h k",), mosaic=True, chunk=cfg.chunk,
                            interpret=cfg.dots.interpret)[0]
    return jax.vjp(functools.partial(_decay_sums, cfg), g)[1]((dgamma, dsigma))[0]


def _scan_cumsum(g, chunk, interpret):
    return (decay_scan_mosaic.decay_cumsum(g, chunk, interpret=interpret),)


def _scan_pullback(dgamma, dsigma, chunk, interpret):
    return (decay_scan_mosaic.decay_sums_pullback(dgamma, dsigma, chunk, interpret=interpret),)


def _dots_at(precision, dots):
    """``dots`` at ``precision`` (None: ``dots`` as they are)."""
    return dots if precision is None else Dots(precision, dots.interpret)


def _wy_kernel(cfg, kernel, ins, cts=None):
    """``kernel(*ins)`` (a forward of ``_wy_kernels``), or ``kernel(*ins, *cts)`` (a pullback:
    cotangents of ``ins[:6]`` cast to their dtypes, None for a missing decay, and with a
    per-channel decay σ's after γ's), through ``_kernel_call``; ``ins`` = (q, k, kw, v, beta,
    the decay input: g, or γ for the per-channel kernels, ``_kernel_ins``), then the forward's
    T (and P) for a pullback."""
    o = cfg.options
    vector = cfg.decay == "vector"
    in_axes = ((_WY_VECTOR_IN if vector else _WY_IN) | _WY_T
               | (dict(P=_WY_OUT["dP"]) if cfg.decay == "scalar" else {}))
    args, axes = dict(zip(in_axes, ins)), dict(in_axes)
    out_axes = tuple(_WY_OUT.values()) + tuple(_WY_T.values())
    dots, warps = cfg.dots, o.wy_warps or (8 if cfg.decay == "vector" else o.num_warps)
    if cts is not None:
        args |= dict(zip(_WY_OUT, cts))
        axes |= _WY_OUT
        out_axes = tuple(a for a, x in zip(in_axes.values(), ins[:6]) if x is not None)
        out_axes += out_axes[-1:] * vector  # dσ, laid out as γ
        dots, warps = cfg.pdots, o.pullback_warps or (o.num_warps if cfg.decay == "none" else 8)
    static = {} if cts is not None else dict(out_dtype=jnp.dtype(o.wy_dtype))
    if vector:
        static["factored_blocks"] = o.vector_wy != "halving"
    elif cts is None:
        dots = _dots_at(o.wy_precision, dots)
        static["apply_dots"] = _dots_at(o.wy_apply_precision, dots)
        if o.fused_grads:  # T's one reader is grads_mosaic, in bf16
            static["t_dtype"] = jnp.dtype(jnp.bfloat16)
    outs = _kernel_call(cfg, kernel, args, axes, out_axes, chunk=cfg.chunk, block_v=o.block_v,
                        block_k=o.wy_block_k or o.block_k, dots=dots, num_warps=warps,
                        num_stages=o.num_stages, **static)
    if cts is None:
        return outs
    outs = iter(outs)
    return tuple(None if x is None else next(outs).astype(x.dtype)
                 for x in ins[:6] + ins[5:6] * vector)


def _stored(cfg, wy):
    """``prepare``'s six WY tensors as the kernels store them: W, U, K̃', Q', P in
    ``Options.wy_dtype``, Γ_C float32."""
    dtype = jnp.dtype(cfg.options.wy_dtype)
    return tuple(x.astype(dtype) for x in wy[:5]) + (wy[5],)


def _kernel_ins(cfg, ins):
    """The WY kernels' inputs for ``ins`` = (q, k, kw, v, beta, g): the same, but γ for g with a
    per-channel decay. The scalar-decay kernels sum g in each chunk themselves; the per-channel
    ones gather rows of γ (the pivots of their factored grams), so γ comes from XLA
    (``_gamma``), and their dγ and dσ go back to dg there (``_wy_pullback``): in-kernel sums
    cost them 3x the code and 10x the spills (NOTES, v8.8)."""
    return tuple(ins[:5]) + (_gamma(cfg, ins[5]),) if cfg.decay == "vector" else tuple(ins)


def _wy(cfg, ins):
    """The six WY tensors of ``ins`` = (q, k, kw, v, beta, g) and what their kernel pullback
    needs besides ``ins``: (T,) from the kernels ((T, P) with a scalar decay, (T, γ) with a
    per-channel one: γ is computed once), () from ``prepare`` in plain JAX (per-channel decay,
    ``vector_wy="xla"``)."""
    if _xla_wy(cfg):
        return _stored(cfg, prepare(cfg, *ins)), ()
    kins = _kernel_ins(cfg, ins)
    if cfg.decay == "vector" and cfg.options.vector_wy == "mosaic":
        wy = _kernel_call(cfg, wy_vector_mosaic.wy_vector_fwd, dict(zip(_WY_VECTOR_IN, kins)),
                          _WY_VECTOR_IN, tuple(_WY_OUT.values()) + tuple(_WY_T.values()), mosaic=True,
                          interpret=cfg.dots.interpret, passes=cfg.options.inverse_passes or 3,
                          t_dtype=jnp.bfloat16 if _mosaic_pullback(cfg) else jnp.float32)
    else:
        wy = _wy_kernel(cfg, _wy_kernels(cfg)[0], kins)
    last = {"none": (), "scalar": (wy[4],), "vector": kins[5:6]}[cfg.decay]
    return wy[:6], wy[6:] + last  # T and P for wy_bwd, T and γ for wy_vector_bwd


def _wy_pullback(cfg, ins, extra=None):
    """(WY tensors, pullback of the WY step at ``ins``): with ``extra`` (``_wy``'s second result,
    the forward having run) the pullback kernel alone; without, the forward first."""
    if _xla_wy(cfg):
        wy, vjp = jax.vjp(functools.partial(prepare, cfg), *ins)
        return _stored(cfg, wy), lambda cts: vjp(tuple(c.astype(w.dtype) for c, w in zip(cts, wy)))
    wy = None
    if extra is None:
        wy, extra = _wy(cfg, ins)
    if cfg.decay != "vector":
        return wy, functools.partial(_wy_kernel, cfg, _wy_kernels(cfg)[1], tuple(ins) + extra)
    (T, gamma), g = extra, ins[5]
    if _mosaic_pullback(cfg):
        return wy, functools.partial(_mosaic_wy_pullback, cfg, tuple(ins[:5]) + (gamma, T), g)

    def pullback(cts):
        *grads, dgamma, dsigma = _wy_kernel(cfg, wy_vector_bwd, tuple(ins[:5]) + (gamma, T), cts)
        return (*grads, _log_decay_grads(cfg, g, dgamma, dsigma))

    return wy, pullback


def _mosaic_pullback(cfg):
    """Whether the per-channel WY pullback is ``wy_vector_pullback_mosaic``
    (``Options.vector_pullback``; ``resolve`` has checked that the forward is Mosaic's)."""
    return cfg.decay == "vector" and cfg.options.vector_pullback == "mosaic"


def _mosaic_wy_pullback(cfg, ins, g, cts):
    """Cotangents of (q, k, kw, v, beta, g) from those of the WY tensors by
    ``wy_vector_pullback_mosaic`` (``ins`` = q, k, kw, v, beta, γ, T; it returns dg itself)."""
    axes = _WY_VECTOR_IN | _WY_T | _WY_OUT
    args = dict(zip(axes, ins + tuple(cts)))
    grads = _kernel_call(cfg, wy_vector_pullback_mosaic.wy_vector_bwd, args, axes,
                         tuple(_WY_VECTOR_IN.values()), mosaic=True,
                         interpret=cfg.dots.interpret)
    return tuple(d.astype(x.dtype) for d, x in zip(grads, ins[:5] + (g,)))


_STATE_AXES = dict(triton="b h c k v", mosaic="b h c v k")  # the saved chunk states' layout
_WY_ARGS = ("W", "U", "kw", "q", "P", "gc")  # the recurrence kernels' names for the WY tensors
_WY_AXES = dict(zip(_WY_ARGS, _WY_OUT.values()))


def _decay_sums(cfg, g):
    """(γ, σ) = ``decay_sums`` of the log decays g over each chunk, in the kernels' layout
    [B, Tp, H(, K)]."""
    B, Tp = g.shape[:2]
    sums = decay_sums(g.reshape(B, Tp // cfg.chunk, cfg.chunk, *g.shape[2:]), 2)
    return tuple(x.reshape(g.shape) for x in sums)


def _gamma(cfg, g):
    """The in-chunk cumsum γ of the log decays g in the kernels' layout (the fused kernels' and
    the per-channel WY kernels' input; the scalar WY kernels sum g themselves): XLA's, or
    ``decay_scan_mosaic``'s kernel with a per-channel decay (``Options.decay_scan``)."""
    if cfg.decay == "vector" and cfg.options.decay_scan == "mosaic":
        return _kernel_call(cfg, _scan_cumsum, dict(g=g), dict(g="b t h k"), ("b t h k",),
                            mosaic=True, chunk=cfg.chunk, interpret=cfg.dots.interpret)[0]
    return _decay_sums(cfg, g)[0]


def _forward(cfg, q, k, kw, v, beta, g, init, doc, first, last, store_states, wy=None):
    o = cfg.options
    if o.split:
        if wy is None:
            wy = _wy(cfg, (q, k, kw, v, beta, g))[0]
        args = dict(zip(_WY_ARGS, wy)) | dict(initial_state=init, doc=doc, first=first, last=last)
        axes = dict(_WY_AXES, initial_state="n h k v", **_FLAGS)
        kernel, static = split_forward, dict(out_dtype=v.dtype, pdots=cfg.pdots,
                                             serial_block_v=o.serial_block_v,
                                             state_dtype=jnp.dtype(o.state_dtype),
                                             output_in_serial=o.output_in_serial,
                                             serial_backend=o.serial_backend,
                                             pieces=o.sequence_pieces)
    else:
        A = P = None
        gamma = None if g is None else _gamma(cfg, g)
        if cfg.decay == "vector":
            A, P = (_flat(x) for x in chunk_grams(*_views(cfg, q, k, kw, beta, gamma)))
        args = dict(q=q, k=k, kw=kw, v=v, beta=beta, gamma=gamma, A=A, P=P, initial_state=init,
                    doc=doc, first=first, last=last)
        axes = dict(q="b t h k", k="b t h k", kw="b t h k", v="b t h v", beta="b t h",
                    gamma="b t h k" if cfg.decay == "vector" else "b t h", A="b h t s",
                    P="b h t s", initial_state="n h k v", **_FLAGS)
        kernel, static = delta_fwd, dict(decay=cfg.decay)
    saved = (_STATE_AXES[o.serial_backend],) + (("b h t v",) if o.split else ())  # states, R
    out_axes = ("b t h v", "n h k v") + (saved if store_states else ())
    return _kernel_call(cfg, kernel, args, axes, out_axes, mosaic=o.serial_backend == "mosaic",
                        chunk=cfg.chunk, scale=cfg.scale,
                        num_docs=cfg.num_docs, block_v=o.block_v, dots=cfg.sdots,
                        num_warps=o.num_warps, num_stages=o.num_stages, store_states=store_states,
                        **static)


_ROWS = dict(T="b h t s", P="b h t s", gc="b h c k", vecs="b h r t")  # _inverse_and_vectors'


def _inverse_and_vectors(cfg, ins):
    """``Options.wy_in_serial``'s WY step on ``ins`` = (q, k, kw, v, beta, g): T (bf16), P, Γ_C
    and the row vectors β, βΓ, Γ, Γ_C/Γ, from ``Options.inverse_backend``'s ``wy_inverse``
    (the Mosaic one given the in-chunk sums of g, the Triton one summing g itself); with
    ``Options.p_in_serial`` P is None and the rows end with γ, for the passes to form P."""
    q, k, kw, _, beta, g = ins
    o, bf16 = cfg.options, jnp.dtype(jnp.bfloat16)
    args, axes = dict(q=q, k=k, kw=kw, beta=beta), dict(_WY_IN)
    if o.inverse_backend == "mosaic":
        sums = (jnp.zeros(beta.shape, jnp.float32),) * 2 if g is None else _decay_sums(cfg, g)
        args |= dict(zip(("gamma", "sigma"), sums))
        axes |= dict(gamma="b t h", sigma="b t h")
        static = dict(mosaic=True, interpret=cfg.dots.interpret, passes=o.inverse_passes or 2)
        if o.p_in_serial:  # T and the rows with γ; P formed by the state passes
            del args["q"]
            gc, T, vecs = _kernel_call(cfg, inverse_mosaic.wy_inverse_rows, args, axes,
                                       tuple(_ROWS[n] for n in ("gc", "T", "vecs")), **static)
            return T, None, gc, vecs
        kernel = inverse_mosaic.wy_inverse
    else:
        args["g"] = g
        kernel, static = wy_inverse, dict(
            chunk=cfg.chunk, dots=_dots_at(o.wy_precision, cfg.dots),
            num_warps=o.wy_warps or o.num_warps, num_stages=o.num_stages,
            block_k=o.wy_block_k or o.block_k, out_dtype=bf16, t_dtype=bf16)
    P, gc, T, vecs = _kernel_call(cfg, kernel, args, axes,
                                  tuple(_ROWS[n] for n in ("P", "gc", "T", "vecs")), **static)
    return T, P, gc, vecs


def _serial_wy_forward(cfg, ins, wy, init, doc, first, last, store):
    """``Options.wy_in_serial``'s forward: (o, final) and, if ``store``, the chunk states and R
    from ``state_wy_mosaic`` given ``wy`` = ``_inverse_and_vectors(cfg, ins)``."""
    q, k, kw, v = ins[:4]
    args = dict(zip(_ROWS, wy)) | dict(k=k, kw=kw, v=v, q=q, initial_state=init, doc=doc,
                                       first=first, last=last)
    axes = _ROWS | dict(_WY_IN, initial_state="n h k v", **_FLAGS)
    *saved, final, o = _kernel_call(
        cfg, state_wy_mosaic.state_fwd, args, axes,
        (_STATE_AXES["mosaic"], "b h t v")[:2 * store] + ("n h k v", "b t h v"), mosaic=True,
        scale=cfg.scale, out_dtype=v.dtype, num_docs=cfg.num_docs,
        interpret=cfg.dots.interpret, store=store,
        warpgroups=cfg.options.forward_warpgroups or (2 if store and cfg.options.p_in_serial
                                                      else 1))
    return (o, final, *saved)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, kw, v, beta, g, init, doc, first, last):
    ins = (q, k, kw, v, beta, g)
    if cfg.options.wy_in_serial:
        return _serial_wy_forward(cfg, ins, _inverse_and_vectors(cfg, ins), init, doc, first,
                                  last, False)
    return _forward(cfg, *ins, init, doc, first, last, False)


def _core_fwd(cfg, q, k, kw, v, beta, g, init, doc, first, last):
    opts = cfg.options
    save = opts.split and opts.save_wy and not _xla_wy(cfg)
    ins = (q, k, kw, v, beta, g)
    if opts.wy_in_serial:
        wy = _inverse_and_vectors(cfg, ins)
        o, final, *saved = _serial_wy_forward(cfg, ins, wy, init, doc, first, last, True)
        return (o, final), (ins, init, doc, first, last, saved, wy, None)
    wy, extra = _wy(cfg, ins) if save else (None, None)
    o, final, *saved = _forward(cfg, *ins, init, doc, first, last, True, wy)
    return (o, final), (ins, init, doc, first, last, saved, wy, extra)


def _state_backward(cfg, wy, res, cts, out_axes, **extra):
    """The recurrence kernels' backward (``split_backward``, or the fused ``delta_bwd``) on the WY
    tensors ``wy`` and the forward's saved states and R (in ``res``), through ``_kernel_call``."""
    _, _, doc, first, last, saved, _, _ = res
    (do, dfinal), o = cts, cfg.options
    args = dict(zip(_WY_ARGS, wy)) | dict(zip(("states", "R"), saved)) | dict(
        do=do, dfinal=dfinal, doc=doc, first=first, last=last)
    axes = dict(_WY_AXES, states=_STATE_AXES[o.serial_backend], R="b h t v", do="b t h v",
                dfinal="n h k v", **_FLAGS)
    split = dict(pdots=cfg.pdots, block_k=o.block_k, serial_block_v=o.serial_block_v,
                 state_dtype=jnp.dtype(o.state_dtype), dout_in_serial=o.dout_in_serial,
                 serial_backend=o.serial_backend, pieces=o.sequence_pieces, **extra)
    return _kernel_call(cfg, split_backward if o.split else delta_bwd, args, axes, out_axes,
                        mosaic=o.serial_backend == "mosaic", chunk=cfg.chunk, scale=cfg.scale,
                        block_v=o.block_v, dots=cfg.sdots,
                        num_warps=o.num_warps, num_stages=o.num_stages,
                        **(split if o.split else {}))


def _fused_bwd(cfg, res, cts):
    """``_core_bwd`` with ``Options.fused_grads``: the dO products and the Mosaic backward state
    pass, then ``grads_mosaic.chunk_grads_fused`` from the forward's T, states and R; dg is the
    pullback of γ (the in-chunk cumsum) applied to its dG."""
    ins, init, doc, first, last, (states, R), wy, extra = res
    (q, k, kw, v, beta, g), do = ins, cts[0]
    out_axes, do16 = ("b h t v", _STATE_AXES["mosaic"], "n h k v"), do.astype(jnp.bfloat16)
    if cfg.options.wy_in_serial:
        T, P = wy[:2]
        o = cfg.options
        A = None if P is None else _kernel_call(  # None: formed in the pass from P's inputs
            cfg, dout_products, dict(P=P, do=do), dict(P="b h t s", do="b t h v"), ("b h t v",),
            q=None, chunk=cfg.chunk, scale=cfg.scale, block_v=o.block_v, dots=cfg.pdots,
            num_warps=o.num_warps, num_stages=o.num_stages,
            state_dtype=jnp.dtype(jnp.bfloat16), transposed=True, with_G=False)[0]
        args = dict(T=T, gc=wy[2], vecs=wy[3], k=k, kw=kw, q=q, A=A, do=do16, dfinal=cts[1],
                    doc=doc, first=first, last=last)
        axes = _ROWS | dict(_WY_IN, A="b h t v", do="b t h v", dfinal="n h k v", **_FLAGS)
        dU, dstates, dinit = _kernel_call(cfg, state_wy_mosaic.state_bwd, args, axes, out_axes,
                                          mosaic=True, scale=cfg.scale,
                                          interpret=cfg.dots.interpret)
    else:
        if wy is None:
            wy, extra = _wy(cfg, ins)
        dU, dstates, dinit = _state_backward(cfg, wy, res, cts, out_axes, with_grads=False)
        T = extra[0]
    gamma, to_dg = ((jnp.zeros(beta.shape, jnp.float32), None) if g is None
                    else jax.vjp(functools.partial(_gamma, cfg), g))
    args = dict(q=q, k=k, kw=kw, v=v, do=do16, T=T, beta=beta,
                gamma=gamma, R=R, dR=dU, states=states, dstates=dstates)
    axes = dict(_WY_IN, do="b t h v", T="b h t s", gamma="b t h", R="b h t v", dR="b h t v",
                states=_STATE_AXES["mosaic"], dstates=_STATE_AXES["mosaic"])
    *grads, dG = _kernel_call(cfg, chunk_grads_fused, args, axes,
                              tuple(axes[n] for n in ("q", "k", "kw", "v", "beta", "gamma")),
                              mosaic=True, scale=cfg.scale, interpret=cfg.dots.interpret,
                              warpgroups=cfg.options.grads_warpgroups)
    dg = None if to_dg is None else to_dg(dG)[0]  # dg_t = Σ_{i >= t} dG_i within the chunk
    return (*match_types((*grads, dg, None if init is None else dinit), (*ins, init)),
            None, None, None)


def _core_bwd(cfg, res, cts):
    if cfg.options.fused_grads:
        return _fused_bwd(cfg, res, cts)
    ins, init, _, _, _, _, wy, extra = res
    recomputed, pullback = _wy_pullback(cfg, ins, extra)  # the forward's WY tensors if saved
    out_axes = ("j b h t k", "b h t v", "j b h t k", "j b h t k", "j b h t s", "j b h c k",
                "n h k v")
    dW, dU, dkw, dq, dP, dgc, dinit = _state_backward(
        cfg, recomputed if wy is None else wy, res, cts, out_axes)
    grads = pullback((dW.sum(0), dU, dkw.sum(0), dq.sum(0), dP.sum(0), dgc.sum(0)))
    return (*match_types((*grads, None if init is None else dinit), (*ins, init)),
            None, None, None)


_core.defvjp(_core_fwd, _core_bwd)
_core = lowered_once(_core)


def vector_mosaic_runs_here(*, decay, interpret, chunk, K, V, dtype) -> bool:
    """Whether ``wy_vector_mosaic`` can run this call compiled here: a per-channel decay, a
    Hopper GPU, not interpret mode, and the shapes and dtype it takes (``grads_mosaic``'s)."""
    return (decay == "vector" and not interpret and state_mosaic.hopper()
            and grads_mosaic.fits(chunk=chunk, K=K, V=V, dtype=dtype))


def resolve(options: Options, *, sixteen_bit: bool, mosaic_fits: bool = False,
            grads_fit: bool = False, vector_mosaic_fits: bool = False) -> Options:
    """``options`` with the input-dependent defaults filled in (``Options``' docstring):
    precision "tf32" for 16-bit inputs, else "tf32x3"; parallel_precision "bf16" and
    state_dtype "bfloat16" for 16-bit inputs when ``precision`` was left None, else
    ``precision`` and "float32"; serial_backend "mosaic" when ``mosaic_fits`` (a GPU, not
    interpret mode, shapes ``state_mosaic`` takes), the inputs are 16-bit, ``precision`` was
    left None and no option clashes, else "triton"; "mosaic" sets wy_dtype, state_dtype and
    serial_precision to bf16 (ValueError without 16-bit inputs) and wy_apply_precision, unless
    given, to "bf16"; wy_dtype otherwise "bfloat16" with vector_wy "mosaic", else "float32";
    output_in_serial and dout_in_serial as the backend's defaults; fused_grads on with the
    Mosaic passes where ``grads_fit`` (bf16 inputs, no or a scalar decay, shapes
    ``grads_mosaic`` takes); vector_wy "mosaic" where ``vector_mosaic_fits``
    (``vector_mosaic_runs_here``), ``precision`` was left None, the pipeline is split and
    wy_dtype is not "float32", else "kernel"; vector_pullback as vector_wy ("mosaic" needs the
    Mosaic forward: ValueError otherwise)."""
    fast16 = sixteen_bit and options.precision is None
    precision = options.precision or ("tf32" if sixteen_bit else "tf32x3")
    if options.vector_wy is None:
        auto = (vector_mosaic_fits and fast16 and options.split
                and options.wy_dtype in (None, "bfloat16"))
        options = dataclasses.replace(options, vector_wy="mosaic" if auto else "kernel")
    if options.vector_pullback is None:
        options = dataclasses.replace(
            options, vector_pullback="mosaic" if options.vector_wy == "mosaic" else "kernel")
    if options.vector_pullback == "mosaic" and options.vector_wy != "mosaic":
        raise ValueError("Options.vector_pullback='mosaic' needs the Mosaic WY forward "
                         f"(vector_wy='mosaic'), got vector_wy={options.vector_wy!r}")
    if options.serial_backend is None:
        auto = mosaic_fits and fast16 and not options.mosaic_clashes()
        options = dataclasses.replace(options, serial_backend="mosaic" if auto else "triton")
    mosaic = options.serial_backend == "mosaic"
    options = dataclasses.replace(
        options,
        output_in_serial=mosaic if options.output_in_serial is None else options.output_in_serial,
        dout_in_serial=mosaic if options.dout_in_serial is None else options.dout_in_serial,
        fused_grads=mosaic and grads_fit if options.fused_grads is None else options.fused_grads)
    if options.serial_backend == "mosaic":
        if not sixteen_bit:
            raise ValueError("Options.serial_backend='mosaic' takes 16-bit q, k, k̃ and v "
                             "(bf16 serial passes); use serial_backend='triton' for float32")
        options = dataclasses.replace(options, wy_dtype="bfloat16", state_dtype="bfloat16",
                                      serial_precision="bf16",
                                      wy_apply_precision=options.wy_apply_precision or "bf16")
    return dataclasses.replace(
        options, precision=precision,
        parallel_precision=options.parallel_precision or ("bf16" if fast16 else precision),
        state_dtype=options.state_dtype or ("bfloat16" if fast16 else "float32"),
        wy_dtype=options.wy_dtype or ("bfloat16" if options.vector_wy == "mosaic" else "float32"))


def _pieces(options, programs, chunks, dense):
    """``Options.sequence_pieces`` for a pass of ``programs`` CTAs over ``chunks`` chunks (None:
    ``sequence_split.auto_pieces`` with the Mosaic passes over dense rows, else 1); ValueError
    for pieces the call cannot take."""
    p, mosaic = options.sequence_pieces, options.serial_backend == "mosaic"
    if p is None:
        return sequence_split.auto_pieces(programs=programs, chunks=chunks) if (
            mosaic and dense) else 1
    if p > 1 and not (mosaic and dense and chunks % p == 0):
        raise ValueError(f"Options.sequence_pieces={p} needs the Mosaic serial passes, dense rows "
                         f"(no cu_seqlens) and a chunk count divisible by it; got "
                         f"serial_backend={options.serial_backend!r}, "
                         f"{'dense' if dense else 'packed'} rows, {chunks} chunks")
    return p


def delta_rule_pallas(q, k, kw, v, beta, log_decay, scale, initial_state, cu_seqlens, chunk_size,
                      options: Options | None = None, interpret: bool | None = None):
    """The delta core (SPEC 2) on the Pallas kernels: o [B, T, H, V] and finals [N, H, K, V].

    Arguments as ``precond_linattn.chunked.delta.delta_rule_chunked``, each in its own dtype;
    ``options`` None: those of ``default_options`` (else ``Options()``).
    Raises ValueError for a head dim or chunk size the kernels cannot take."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    options = _DEFAULT.current if options is None else options
    if not supports(K=K, V=V, dtype=v.dtype, decay=None if log_decay is None else log_decay.ndim):
        raise ValueError(f"impl='pallas' takes head dims K <= {MAX_HEAD_DIM}, got K={K}; "
                         "use impl='chunked' (impl='auto' falls back to it)")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"impl='pallas' needs chunk_size a power of two >= 16, got {chunk_size}")
    if isinstance(scale, jax.core.Tracer):  # a traced scale folds into q (exact, differentiable)
        q, scale = f32(q) * scale, 1.0
    Kp, Vp = pow2_dim(K), pow2_dim(V)
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    nc = layout.doc.shape[1]

    def kernel_layout(x, n=None):
        y = to_chunks(pad_last(x, n) if n else x, layout)
        return y.reshape(B, nc * chunk_size, *y.shape[3:])

    qk = [kernel_layout(x, Kp) for x in (q, k, kw)]
    g = None  # the log decays, float32: the kernels sum them within each chunk
    if log_decay is not None:
        g = kernel_layout(f32(pad_last(log_decay, Kp) if log_decay.ndim == 4 else log_decay))
    init = f32(initial_state)
    if init is not None:
        init = pad_last(jnp.pad(init, [(0, 0), (0, 0), (0, Kp - K), (0, 0)]), Vp)
    last = jnp.zeros(layout.doc.shape, jnp.int32).at[layout.final_row, layout.final_chunk].set(1)
    decay = {None: "none", 3: "scalar", 4: "vector"}[None if log_decay is None else log_decay.ndim]
    interpret = interpret_default() if interpret is None else interpret
    other = [x.dtype for x in (q, k, kw, v) if x.dtype != jnp.bfloat16]  # named if any
    dtype = other[0] if other else jnp.bfloat16
    options = resolve(options, sixteen_bit=all(jnp.dtype(x.dtype).itemsize == 2
                                               for x in (q, k, kw, v)),
                      mosaic_fits=state_mosaic.runs_here(interpret=interpret, chunk=chunk_size,
                                                         K=Kp, V=Vp),
                      grads_fit=decay != "vector" and grads_mosaic.fits(chunk=chunk_size, K=Kp,
                                                                        V=Vp, dtype=dtype),
                      vector_mosaic_fits=vector_mosaic_runs_here(
                          decay=decay, interpret=interpret, chunk=chunk_size, K=Kp, V=Vp,
                          dtype=dtype))
    if options.serial_backend == "mosaic":
        state_mosaic.check_shapes(chunk=chunk_size, K=Kp, V=Vp)
    if decay == "vector" and options.vector_wy == "mosaic":
        wy_vector_mosaic.check_shapes(chunk=chunk_size, K=Kp, V=Vp, dtype=dtype)
        if options.wy_dtype != "bfloat16" or not options.split:
            raise ValueError("Options.vector_wy='mosaic' stores the WY tensors in bf16 for the "
                             "split pipeline: it needs split and wy_dtype 'bfloat16' (or None), "
                             f"got split={options.split}, wy_dtype={options.wy_dtype!r}")
    if options.fused_grads:
        if options.serial_backend != "mosaic" or decay == "vector":
            raise ValueError("Options.fused_grads needs serial_backend='mosaic' and no or a scalar "
                             f"decay; got serial_backend={options.serial_backend!r}, {decay} decay")
        grads_mosaic.check_shapes(chunk=chunk_size, K=Kp, V=Vp, dtype=dtype)
    scan_fits = decay == "vector" and decay_scan_mosaic.fits(g, chunk_size)
    if decay == "vector" and options.decay_scan == "mosaic" and not scan_fits:
        raise ValueError(f"Options.decay_scan='mosaic' needs H*K a multiple of "
                         f"{decay_scan_mosaic.COLS} (K padded to {Kp}), got H={H}")
    options = dataclasses.replace(options, decay_scan=options.decay_scan or (
        "mosaic" if scan_fits and not interpret and state_mosaic.hopper() else "xla"))
    programs = B * H * Vp // state_mosaic.BV  # CTAs of a Mosaic serial pass
    options = dataclasses.replace(options, sequence_pieces=_pieces(options, programs, nc,
                                                                   cu_seqlens is None))
    serial_wy = bool(options.fused_grads) and options.sequence_pieces == 1
    if options.wy_in_serial and not serial_wy:
        raise ValueError("Options.wy_in_serial needs fused_grads and one sequence piece; got "
                         f"fused_grads={options.fused_grads}, "
                         f"sequence_pieces={options.sequence_pieces}")
    options = dataclasses.replace(options, wy_in_serial=serial_wy if options.wy_in_serial is None
                                  else options.wy_in_serial)
    if options.inverse_backend == "mosaic" and not options.wy_in_serial:
        raise ValueError("Options.inverse_backend='mosaic' needs wy_in_serial (fused_grads, one "
                         "sequence piece)")
    options = dataclasses.replace(options, inverse_backend=options.inverse_backend or (
        "mosaic" if options.wy_in_serial else "triton"))
    if options.p_in_serial and options.inverse_backend != "mosaic":
        raise ValueError("Options.p_in_serial needs inverse_backend='mosaic' (and so wy_in_serial)")
    options = dataclasses.replace(options, p_in_serial=options.inverse_backend == "mosaic" if
                                  options.p_in_serial is None else options.p_in_serial)
    if options.forward_warpgroups == 2 and not options.p_in_serial:
        raise ValueError("Options.forward_warpgroups=2 needs p_in_serial (the Mosaic inverse)")
    cfg = _Config(chunk_size, decay, float(scale),
                  None if cu_seqlens is None else layout.num_docs, options,
                  Dots(options.precision, interpret), Dots(options.parallel_precision, interpret))
    o, final = _core(cfg, *vary_alike(*qk, kernel_layout(v, Vp), kernel_layout(beta), g, init,
                                      layout.doc.astype(jnp.int32), layout.first.astype(jnp.int32),
                                      last))
    o = from_chunks(o.reshape(B, nc, chunk_size, H, Vp), layout)[..., :V]
    return o, final[:, :, :K, :V]
