"""``osgm_precondition`` (SPEC 3.1) on Pallas kernels: layout, ``custom_vjp`` wrapper, ``supports``.

Forward: the chunk kernel of ``osgm_chunk_triton`` (one program per batch row and head, d in
registers; per chunk of C tokens the active-set solve on tensor cores, verified in the kernel,
and the exact token loop where it fails; no host synchronisation). Under ``custom_vjp`` the
forward also keeps, as residuals, d at every chunk start, which chunks were fast and d_t of the
fallback chunks (a float32 [B, T, H, K] buffer written on those chunks only). Backward (exact):
the reverse chunk kernel solves the transposed affine map on fast chunks and runs the reverse
token loop on fallback ones, emitting the cotangents of k, β, r and the initial state. The
clip's derivative is that of ``reference.osgm.clip_box`` (0 on and beyond a bound).

Packed documents (``cu_seqlens``) use the document-aligned chunk layout of
``precond_linattn.varlen``; ``chunk_size`` (a power of two >= 16) is C. Head dims are padded to
a power of two >= 16 (keys with zeros, the initial state with ones: padded coordinates never
touch the real ones). The hyper-parameters (η, d_min, d_max, ε) are compiled into the kernels,
so they must be concrete numbers.

Inside a ``jit`` over a device mesh the kernel calls go through ``partition.sharded_call`` (batch
rows and heads stay sharded; with packed documents only heads). Without a GPU the kernels run in
interpret mode.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.osgm_chunk_triton import osgm_chunk_bwd, osgm_chunk_fwd
from pallas_kernels.partition import sharded_call
from pallas_kernels.triton_common import (
    MAX_HEAD_DIM, Dots, interpret_default, pad_last, pow2_dim)
from precond_linattn.numerics import f32
from precond_linattn.varlen import chunk_layout, from_chunks, to_chunks


@dataclasses.dataclass(frozen=True)
class Options:
    """Kernel tuning (static): how many tokens ahead the fallback loops load rows, warps per
    program, precision of the float32 dots ("tf32", "tf32x3", "ieee"; see ``triton_common``)."""

    prefetch: int = 4
    num_warps: int = 4
    precision: str = "tf32x3"


@dataclasses.dataclass(frozen=True)
class _Config:
    hyper: tuple  # (eta, d_min, d_max, eps) as floats
    beta_aware: bool
    packed: bool  # documents packed along T (cu_seqlens)
    chunk: int
    options: Options
    dots: Dots


def supports(*, K: int, dtype) -> bool:
    """Whether the kernels take this call (K up to MAX_HEAD_DIM after padding, any dtype)."""
    del dtype
    return pow2_dim(K) <= MAX_HEAD_DIM


_IN = {"doc": "b c", "first": "b c", "last": "b c", "fast": "b h c", "k": "b t h k",
       "aux": "b t h a", "init": "n h k", "dstart": "b h c k", "dtok": "b t h k",
       "dkw": "b t h k", "dfinal": "n h k"}


def _call(cfg, kernel, args: dict, out_axes, **static):
    """``kernel(*args.values(), **static)`` through ``sharded_call``; "n" (states) is "b" for
    dense rows (each row's state is its own document 0 inside the kernels)."""
    docs = (lambda a: a) if cfg.packed else (lambda a: a.replace("n", "b"))
    o = cfg.options
    fn = functools.partial(kernel, hyper=cfg.hyper, beta_aware=cfg.beta_aware, packed=cfg.packed,
                           chunk=cfg.chunk, dots=cfg.dots, prefetch=o.prefetch,
                           num_warps=o.num_warps, **static)
    return sharded_call(lambda *xs: tuple(fn(*xs)), list(args.values()),
                        [docs(_IN[n]) for n in args], [docs(a) for a in out_axes],
                        shard_batch=not cfg.packed)


def _forward(cfg, flags, k, aux, init, residual):
    """(k̃, final, fast[, dstart, dtok]) of ``osgm_chunk_fwd``."""
    out_axes = ["b t h k", "n h k", "b h c"] + (["b h c k", "b t h k"] if residual else [])
    return _call(cfg, osgm_chunk_fwd, dict(zip(("doc", "first", "last"), flags), k=k, aux=aux,
                                           init=init), out_axes, residual=residual)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(cfg, flags, k, aux, init):
    """(k̃, final d) in the kernel layout."""
    return _forward(cfg, flags, k, aux, init, False)[:2]


def _scan_fwd(cfg, flags, k, aux, init):
    """The forward in residual mode: keeps d at chunk starts, the fast flags and fallback d_t."""
    k_write, final, fast, dstart, dtok = _forward(cfg, flags, k, aux, init, True)
    return (k_write, final), (flags, k, aux, fast, dstart, dtok)


def _scan_bwd(cfg, res, cts):
    """Cotangents of k, aux (β and r columns) and the initial states by the reverse kernel."""
    flags, k, aux, fast, dstart, dtok = res
    dkw, dfinal = cts
    args = dict(zip(("doc", "first", "last"), flags), fast=fast, k=k, aux=aux, dstart=dstart,
                dtok=dtok, dkw=dkw, dfinal=dfinal)
    dk, daux, dinit = _call(cfg, osgm_chunk_bwd, args, ["b t h k", "b t h a", "n h k"])
    return None, dk.astype(k.dtype), daux, dinit


_scan.defvjp(_scan_fwd, _scan_bwd)


def _prepare(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state, cu_seqlens,
             chunk_size, options, interpret):
    """(config, chunk layout, kernel arguments (flags, k, aux, init)) of a call; raises
    ValueError for a head dim, chunk size or hyper-parameter the kernels cannot take."""
    B, T, H, K = k.shape
    if not supports(K=K, dtype=k.dtype):
        raise ValueError(f"impl='pallas' takes head dims K <= {MAX_HEAD_DIM}, got K={K}; "
                         "use impl='chunked' (impl='auto' falls back to it)")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"impl='pallas' needs chunk_size a power of two >= 16, got {chunk_size}")
    hyper = (eta, d_min, d_max, eps)
    if any(isinstance(x, jax.core.Tracer) for x in hyper):
        raise ValueError("impl='pallas' compiles eta, d_min, d_max and eps into the kernels: pass "
                         "numbers, not traced values (or use impl='chunked')")
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    nc = layout.doc.shape[1]
    Kp = pow2_dim(K)

    def kernel_layout(x, fill=0.0):
        y = to_chunks(x, layout, fill)
        return y.reshape(B, nc * chunk_size, *y.shape[3:])

    r = jnp.ones_like(f32(beta)) if retention is None else f32(retention)
    aux = jnp.stack([kernel_layout(f32(beta)), kernel_layout(r, 1.0)], axis=-1)  # BETA, RET
    init = (jnp.ones((layout.num_docs, H, Kp), jnp.float32) if initial_state is None else
            jnp.pad(f32(initial_state), [(0, 0), (0, 0), (0, Kp - K)], constant_values=1.0))
    packed = cu_seqlens is not None
    last = jnp.zeros(layout.doc.shape, jnp.int32).at[layout.final_row, layout.final_chunk].set(1)
    doc = layout.doc if packed else jnp.zeros_like(layout.doc)  # dense: the row's own state
    flags = (doc.astype(jnp.int32), layout.first.astype(jnp.int32), last)
    interpret = interpret_default() if interpret is None else interpret
    cfg = _Config(tuple(float(x) for x in hyper), beta_aware, packed, chunk_size, options,
                  Dots(options.precision, interpret))
    return cfg, layout, (flags, kernel_layout(pad_last(k, Kp)), aux, init)


def osgm_pallas(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state,
                cu_seqlens, chunk_size, options: Options = Options(),
                interpret: bool | None = None):
    """k̃ [B, T, H, K] (k's dtype) and final d [N, H, K] (float32) on the Pallas kernels.

    Arguments as ``precond_linattn.chunked.osgm.osgm_chunked``, each in its own dtype. Raises
    ValueError for a head dim or chunk size the kernels cannot take or traced hyper-parameters."""
    B, T, H, K = k.shape
    cfg, layout, args = _prepare(k, beta, retention, eta, d_min, d_max, beta_aware, eps,
                                 initial_state, cu_seqlens, chunk_size, options, interpret)
    k_write, final = _scan(cfg, *args)
    k_write = from_chunks(k_write.reshape(B, -1, chunk_size, H, k_write.shape[-1]), layout)
    return k_write[..., :K], final[..., :K]


def fast_path_chunks(*args, options: Options = Options(), interpret: bool | None = None):
    """For tests and diagnostics: [B, H, NC] bool, True where the forward kernel kept a chunk's
    active-set solution (False: it ran the token loop). Arguments as ``osgm_pallas``."""
    cfg, _, kernel_args = _prepare(*args, options, interpret)
    return _forward(cfg, *kernel_args, False)[2] != 0
