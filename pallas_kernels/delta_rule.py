"""``delta_rule`` on Pallas kernels: layout, ``custom_vjp`` wrapper, ``supports``.

Forward: the fused Triton-lowered kernel (``delta_fwd_triton``), which also saves the state at
the start of every chunk. Backward (exact, no approximation):

1. ``prepare`` recomputes in plain JAX, in parallel over all chunks, the per-chunk tensors of the
   WY form (SPEC 2.1): W = (I + L)^-1 Diag(β)(K ⊙ Γ), U = (I + L)^-1 Diag(β) V, K̃ ⊙ Γ_C/Γ,
   Q ⊙ Γ, P and Γ_C, and keeps their pullback (``jax.vjp``). (I + L)^-1 is the kernels' doubling
   product (matmuls on tensor cores, at the kernels' precision), not ``chunk_wy``'s triangular
   solve, whose batched GPU form and transpose were slow (benchmarks/NOTES.md);
2. the Triton-lowered backward kernel (``delta_bwd_triton``) runs the reverse chunk recurrence
   for dS and emits the cotangents of those tensors and of the initial state;
3. the pullback of step 1 turns them into the cotangents of q, k, k̃, v, β and the log decay.

Packed documents (``cu_seqlens``) use the document-aligned chunk layout of
``precond_linattn.varlen``; head dims are zero-padded to a power of two >= 16 (exact: padded key
channels and value columns stay zero). Without a GPU the same kernels run in interpret mode.

Inside a ``jit`` over a device mesh both kernel calls go through ``partition.sharded_call``: they
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
from pallas_kernels.delta_fwd_triton import delta_fwd
from pallas_kernels.partition import sharded_call
from pallas_kernels.triton_common import (
    MAX_HEAD_DIM, Dots, interpret_default, pad_last, pow2_dim, unit_lower_inverse)
from precond_linattn.chunked.delta import chunk_grams, chunk_wy
from precond_linattn.numerics import f32
from precond_linattn.varlen import chunk_layout, from_chunks, to_chunks



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
    num_docs: int | None  # documents packed along T (cu_seqlens); None: one per batch row
    options: Options
    dots: Dots


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


def prepare(cfg, q, k, kw, v, beta, gamma):
    """Per-chunk WY tensors for the backward kernel, in its layout (see module docstring).

    Returns W, U, K̃ ⊙ Γ_C/Γ, Q ⊙ Γ [B, H, Tp, ·], P [B, H, Tp, C], Γ_C [B, H, NC, K]."""
    qc, kc, kwc, vc, bc, gc = _views(cfg, q, k, kw, v, beta, gamma)
    W, U, kw_tail, q_dec, P, Gam_C = chunk_wy(
        qc, kc, kwc, vc, bc, gc, solve=lambda L, rhs: cfg.dots.nn(unit_lower_inverse(L, cfg.dots), rhs))
    GC = jnp.broadcast_to(Gam_C[..., 0], kc.shape[:3] + kc.shape[-1:])
    return _flat(W), _flat(U), _flat(kw_tail), _flat(q_dec), _flat(P), GC


def _kernel_call(cfg, kernel, args: dict, axes: dict, out_axes, **static):
    """``kernel(**args, **static)`` through ``sharded_call``; None arguments stay None. ``axes``
    names each argument's dimensions; "n" (document states) is the batch factor "b" when every
    row is one document."""
    names = [n for n, x in args.items() if x is not None]
    packed = cfg.num_docs is not None
    docs = lambda a: a if packed else a.replace("n", "b")  # noqa: E731

    def call(*xs):
        given = dict(zip(names, xs))
        if not packed:  # row b is document b: ids relative to the shard's first row
            given["doc"] = given["doc"] - given["doc"][:1, :1]
        return tuple(kernel(**{**dict.fromkeys(args), **given}, **static))

    return sharded_call(call, [args[n] for n in names], [docs(axes[n]) for n in names],
                        [docs(a) for a in out_axes], shard_batch=not packed)


_FLAGS = {"doc": "b c", "first": "b c", "last": "b c"}


def _forward(cfg, q, k, kw, v, beta, gamma, init, doc, first, last, store_states):
    A = P = None
    if cfg.decay == "vector":
        A, P = (_flat(x) for x in chunk_grams(*_views(cfg, q, k, kw, beta, gamma)))
    o = cfg.options
    args = dict(q=q, k=k, kw=kw, v=v, beta=beta, gamma=gamma, A=A, P=P, initial_state=init,
                doc=doc, first=first, last=last)
    axes = dict(q="b t h k", k="b t h k", kw="b t h k", v="b t h v", beta="b t h",
                gamma="b t h k" if cfg.decay == "vector" else "b t h", A="b h t s", P="b h t s",
                initial_state="n h k v", **_FLAGS)
    out_axes = ("b t h v", "n h k v") + (("b h c k v",) if store_states else ())
    return _kernel_call(cfg, delta_fwd, args, axes, out_axes, chunk=cfg.chunk, decay=cfg.decay,
                        scale=cfg.scale, num_docs=cfg.num_docs, block_v=o.block_v, dots=cfg.dots,
                        num_warps=o.num_warps, num_stages=o.num_stages, store_states=store_states)


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
    W, U, kw_t, q_dec, P, gc = wy
    args = dict(W=W, U=U, kw=kw_t, q=q_dec, P=P, gc=gc, states=states, do=do, dfinal=dfinal,
                doc=doc, first=first, last=last)
    axes = dict(W="b h t k", U="b h t v", kw="b h t k", q="b h t k", P="b h t s", gc="b h c k",
                states="b h c k v", do="b t h v", dfinal="n h k v", **_FLAGS)
    out_axes = ("j b h t k", "b h t v", "j b h t k", "j b h t k", "j b h t s", "j b h c k",
                "n h k v")
    dW, dU, dkw, dq, dP, dgc, dinit = _kernel_call(
        cfg, delta_bwd, args, axes, out_axes, chunk=cfg.chunk, scale=cfg.scale,
        block_v=o.block_v, dots=cfg.dots, num_warps=o.num_warps, num_stages=o.num_stages)
    grads = pullback((dW.sum(0), dU, dkw.sum(0), dq.sum(0), dP.sum(0), dgc.sum(0)))
    return (*grads, None if init is None else dinit, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


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
    Kp, Vp = pow2_dim(K), pow2_dim(V)
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    nc = layout.doc.shape[1]

    def kernel_layout(x, n=None):
        y = to_chunks(pad_last(x, n) if n else x, layout)
        return y.reshape(B, nc * chunk_size, *y.shape[3:])

    qk = [kernel_layout(x, Kp) for x in (q, k, kw)]
    gamma = None
    if log_decay is not None:
        g = to_chunks(f32(pad_last(log_decay, Kp) if log_decay.ndim == 4 else log_decay), layout)
        gamma = jnp.cumsum(g, axis=2).reshape(B, nc * chunk_size, *g.shape[3:])
    init = f32(initial_state)
    if init is not None:
        init = pad_last(jnp.pad(init, [(0, 0), (0, 0), (0, Kp - K), (0, 0)]), Vp)
    last = jnp.zeros(layout.doc.shape, jnp.int32).at[layout.final_row, layout.final_chunk].set(1)
    decay = {None: "none", 3: "scalar", 4: "vector"}[None if log_decay is None else log_decay.ndim]
    interpret = interpret_default() if interpret is None else interpret
    precision = options.precision or (
        "tf32" if all(jnp.dtype(x.dtype).itemsize == 2 for x in (q, k, kw, v)) else "tf32x3")
    cfg = _Config(chunk_size, decay, float(scale),
                  None if cu_seqlens is None else layout.num_docs, options, Dots(precision, interpret))
    o, final = _core(cfg, *qk, kernel_layout(v, Vp), kernel_layout(beta), gamma, init,
                     layout.doc.astype(jnp.int32), layout.first.astype(jnp.int32), last)
    o = from_chunks(o.reshape(B, nc, chunk_size, H, Vp), layout)[..., :V]
    return o, final[:, :, :K, :V]
