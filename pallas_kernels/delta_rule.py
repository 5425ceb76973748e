"""``delta_rule`` on Pallas kernels: layout, ``custom_vjp`` wrapper, ``supports``.

Forward: the fused Triton-lowered kernel (``delta_fwd_triton``), which also saves the state at
the start of every chunk. Backward (exact, no approximation):

1. ``prepare`` recomputes in plain JAX, in parallel over all chunks, the per-chunk tensors of the
   WY form (SPEC 2.1): W = (I + L)^-1 Diag(β)(K ⊙ Γ), U = (I + L)^-1 Diag(β) V, K̃ ⊙ Γ_C/Γ,
   Q ⊙ Γ, P and Γ_C, and keeps their pullback (``jax.vjp``);
2. the Triton-lowered backward kernel (``delta_bwd_triton``) runs the reverse chunk recurrence
   for dS and emits the cotangents of those tensors and of the initial state;
3. the pullback of step 1 turns them into the cotangents of q, k, k̃, v, β and the log decay.

Packed documents (``cu_seqlens``) use the document-aligned chunk layout of
``precond_linattn.varlen``; head dims are zero-padded to a power of two >= 16 (exact: padded key
channels and value columns stay zero). Without a GPU the same kernels run in interpret mode.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.delta_bwd_triton import delta_bwd
from pallas_kernels.delta_fwd_triton import delta_fwd
from pallas_kernels.triton_common import Dots, interpret_default
from precond_linattn.chunked.delta import chunk_grams, chunk_wy
from precond_linattn.numerics import f32
from precond_linattn.varlen import chunk_layout, from_chunks, to_chunks

MAX_HEAD_DIM = 128  # padded K; larger states do not fit one program's registers


@dataclasses.dataclass(frozen=True)
class Options:
    """Kernel tuning (static). ``precision``: that of float32 dots on tensor cores ("tf32",
    "tf32x3", "ieee"); None picks "tf32" when q, k, k̃ and v are all 16-bit and "tf32x3" (about
    fp32) otherwise: see benchmarks/NOTES.md for the errors measured with each."""

    precision: str | None = None
    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class _Config:
    chunk: int
    decay: str  # "none" | "scalar" | "vector"
    scale: float
    num_docs: int
    options: Options
    dots: Dots


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def supports(*, K: int, V: int, dtype, decay) -> bool:
    """Whether the kernels take this call (any V; K up to MAX_HEAD_DIM after padding)."""
    del V, dtype, decay  # every V is tiled, every supported dtype and decay is handled
    return _pow2(K) <= MAX_HEAD_DIM


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


def prepare(cfg, q, k, kw, v, beta, gamma):
    """Per-chunk WY tensors for the backward kernel, in its layout (see module docstring).

    Returns W, U, K̃ ⊙ Γ_C/Γ, Q ⊙ Γ [B, H, Tp, ·], P [B, H, Tp, C], Γ_C [B, H, NC, K]."""
    qc, kc, kwc, vc, bc, gc = _views(cfg, q, k, kw, v, beta, gamma)
    W, U, kw_tail, q_dec, P, Gam_C = chunk_wy(qc, kc, kwc, vc, bc, gc)
    GC = jnp.broadcast_to(Gam_C[..., 0], kc.shape[:3] + kc.shape[-1:])
    return _flat(W), _flat(U), _flat(kw_tail), _flat(q_dec), _flat(P), GC


def _forward(cfg, q, k, kw, v, beta, gamma, init, doc, first, last, store_states):
    A = P = None
    if cfg.decay == "vector":
        A, P = (_flat(x) for x in chunk_grams(*_views(cfg, q, k, kw, beta, gamma)))
    o = cfg.options
    return delta_fwd(q, k, kw, v, beta, gamma, A, P, init, doc, first, last, chunk=cfg.chunk,
                     decay=cfg.decay, scale=cfg.scale, num_docs=cfg.num_docs, block_v=o.block_v,
                     dots=cfg.dots, num_warps=o.num_warps, num_stages=o.num_stages,
                     store_states=store_states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, kw, v, beta, gamma, init, doc, first, last):
    return _forward(cfg, q, k, kw, v, beta, gamma, init, doc, first, last, False)


def _core_fwd(cfg, q, k, kw, v, beta, gamma, init, doc, first, last):
    o, final, states = _forward(cfg, q, k, kw, v, beta, gamma, init, doc, first, last, True)
    return (o, final), (q, k, kw, v, beta, gamma, init, doc, first, last, states)


def _core_bwd(cfg, res, cts):
    q, k, kw, v, beta, gamma, init, doc, first, last, states = res
    do, dfinal = cts
    wy, pullback = jax.vjp(functools.partial(prepare, cfg), q, k, kw, v, beta, gamma)
    o = cfg.options
    dW, dU, dkw, dq, dP, dgc, dinit = delta_bwd(
        *wy, states, do, dfinal, doc, first, last, chunk=cfg.chunk, scale=cfg.scale,
        block_v=o.block_v, dots=cfg.dots, num_warps=o.num_warps, num_stages=o.num_stages)
    grads = pullback((dW.sum(0), dU, dkw.sum(0), dq.sum(0), dP.sum(0), dgc.sum(0)))
    return (*grads, None if init is None else dinit, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def _pad_last(x, n):
    return x if x is None or x.shape[-1] == n else jnp.pad(
        x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])


def delta_rule_pallas(q, k, kw, v, beta, log_decay, scale, initial_state, cu_seqlens, chunk_size,
                      options: Options = Options(), interpret: bool | None = None):
    """The delta core (SPEC 2) on the Pallas kernels: o [B, T, H, V] and finals [N, H, K, V].

    Arguments as ``precond_linattn.chunked.delta.delta_rule_chunked``, each in its own dtype.
    Raises ValueError for a head dim or chunk size the kernels cannot take."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    if not supports(K=K, V=V, dtype=v.dtype, decay=None if log_decay is None else log_decay.ndim):
        raise ValueError(f"impl='pallas' takes head dims K <= {MAX_HEAD_DIM}, got K={K}; "
                         "use impl='chunked' (impl='auto' falls back to it)")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"impl='pallas' needs chunk_size a power of two >= 16, got {chunk_size}")
    if isinstance(scale, jax.core.Tracer):  # a traced scale folds into q (exact, differentiable)
        q, scale = f32(q) * scale, 1.0
    Kp, Vp = _pow2(K), _pow2(V)
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    nc = layout.doc.shape[1]

    def kernel_layout(x, n=None):
        y = to_chunks(_pad_last(x, n) if n else x, layout)
        return y.reshape(B, nc * chunk_size, *y.shape[3:])

    qk = [kernel_layout(x, Kp) for x in (q, k, kw)]
    gamma = None
    if log_decay is not None:
        g = to_chunks(f32(_pad_last(log_decay, Kp) if log_decay.ndim == 4 else log_decay), layout)
        gamma = jnp.cumsum(g, axis=2).reshape(B, nc * chunk_size, *g.shape[3:])
    init = f32(initial_state)
    if init is not None:
        init = _pad_last(jnp.pad(init, [(0, 0), (0, 0), (0, Kp - K), (0, 0)]), Vp)
    last = jnp.zeros(layout.doc.shape, jnp.int32).at[layout.final_row, layout.final_chunk].set(1)
    decay = {None: "none", 3: "scalar", 4: "vector"}[None if log_decay is None else log_decay.ndim]
    interpret = interpret_default() if interpret is None else interpret
    precision = options.precision or (
        "tf32" if all(jnp.dtype(x.dtype).itemsize == 2 for x in (q, k, kw, v)) else "tf32x3")
    cfg = _Config(chunk_size, decay, float(scale), layout.num_docs, options,
                  Dots(precision, interpret))
    o, final = _core(cfg, *qk, kernel_layout(v, Vp), kernel_layout(beta), gamma, init,
                     layout.doc.astype(jnp.int32), layout.first.astype(jnp.int32), last)
    o = from_chunks(o.reshape(B, nc, chunk_size, H, Vp), layout)[..., :V]
    return o, final[:, :, :K, :V]
