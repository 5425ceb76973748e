"""The split pipeline's two serial state passes as Mosaic GPU kernels (wgmma, TMA; Hopper).

The same recurrences as ``state_fwd_triton.state_pass`` and ``state_bwd_triton.state_pass``
(chunk-aligned documents, per-chunk flags doc / first / last), with FLA's and
jax-linear-attention's numerics: bf16 operands for both dots of a chunk step (the state rounded
to bf16 for W S, R for K̃'ᵀ R), float32 accumulation and carries. One CTA (one warpgroup) per
(batch row, head, 64-wide V tile) holds the transposed carry [64, K] float32 in wgmma registers,
so both dots of a step take their left operand from registers; the next chunk's tiles are
double-buffered by TMA while the current one computes; stores go out through shared memory
by TMA.

    forward  (chunks in order):  S ← init[doc] (or 0) at a document's first chunk
                                 store S;  R = U − W S (stored);  S ← Γ_C ⊙ S + K̃'ᵀ R
                                 final[doc] = S after its last chunk
    backward (chunks reversed):  dS_C ← dfinal[doc] at a document's last chunk;  store dS_C
                                 dR = A + K̃' dS_C (stored as dU);  dS = Γ_C ⊙ dS_C + G − Wᵀ dR
                                 dinit[doc] = dS at its first chunk, where the carry restarts at 0

Layouts: W, K̃' [B, H, Tp, K], U, R, A, dU [B, H, Tp, V] in bf16; Γ_C [B, H, NC, K] float32;
the per-chunk states, their cotangents and G are stored transposed, [B, H, NC, V, K] bf16
(the orientation of the carry; the Triton kernels that read them take ``transposed=True``);
document states [N, H, K, V] float32 as everywhere (transposed around the kernel).

Shapes: chunk 64, K in {64, 128}, V a multiple of 64. wgmma has no CPU lowering in jax 0.11.2
(NotImplementedError "MLIR translation rule for primitive 'wgmma' not found for platform cpu"),
so in interpret mode (CPU) each dot runs as ``jnp.dot`` of the same bf16 operands with float32
accumulation: the CPU tests check everything else (indexing, TMA copies, barriers, document
flags); the wgmma path is checked on the device by benchmarks/bench_delta.py.
"""

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.triton_common import TraceDefaults, out_struct

C = 64  # chunk
BV = 64  # V tile of one CTA
BF16, F32 = jnp.bfloat16, jnp.float32
WGMMA = plgpu.Layout.WGMMA
COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a [BV, K] tile
ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row


@functools.cache
def hopper() -> bool:
    """Whether the default device is an sm_90 GPU (H100 / H200): wgmma is Hopper's alone."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"


def _shape_problem(chunk, K, V) -> str | None:
    """Why the Mosaic passes cannot take chunk, K and V, or None."""
    if chunk != C:
        return f"chunk_size {C}, got {chunk}"
    if K not in (64, 128):
        return f"the (padded) key head dim K in (64, 128), got {K}"
    if V % BV:
        return f"the (padded) value head dim V to be a multiple of {BV}, got {V}"
    return None


def fits(*, chunk, K, V) -> bool:
    """Whether the Mosaic passes take chunk, K and V (``check_shapes`` says why not)."""
    return _shape_problem(chunk, K, V) is None


def runs_here(*, interpret, chunk, K, V) -> bool:
    """Whether the Mosaic passes can be the default for this call: compiled (not interpret
    mode) on a Hopper GPU, for shapes they take."""
    return not interpret and hopper() and fits(chunk=chunk, K=K, V=V)


def check_shapes(*, chunk, K, V):
    """ValueError naming the argument unless the Mosaic passes take chunk, K and V."""
    problem = _shape_problem(chunk, K, V)
    if problem:
        raise ValueError(f"serial_backend='mosaic' needs {problem}")


def smem(shape, dtype):
    """Shared-memory buffer tiled and swizzled for TMA and wgmma (minor dim = last)."""
    swizzle = plgpu.find_swizzle(shape[-1] * jnp.dtype(dtype).itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle)))


def _value(x):
    """An interpret-mode operand's value: registers as they are, a shared-memory ref read."""
    return x if isinstance(x, jax.Array) else x[...]


def matmul(pairs, shape, init, interpret):
    """init + Σ a @ b over ``pairs`` into one float32 accumulator of ``shape`` (a: bf16 registers
    or a shared-memory ref, possibly a ``.T`` view; b: a shared-memory ref; init None: zeros).
    In interpret mode ``jnp.dot`` of the same operands. The optimisation barrier keeps LLVM from
    reading the accumulator before the wgmma wait (jax-linear-attention saw zeroed products
    without it)."""
    if init is None:
        init = plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA)
    if interpret:
        return init + sum(jnp.dot(_value(a), b[...], preferred_element_type=F32) for a, b in pairs)

    def body(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)

    return lax.optimization_barrier(pl.run_state(body)(plgpu.ACC.init(init)))


def products(specs, interpret):
    """Independent float32 products a @ b for ``specs`` = [(a, b, shape), ...] (operands as for
    ``matmul``) issued as one wgmma group with one wait for all, so the tensor cores start the
    next product while the previous one drains (the bits of ``matmul``'s, one product each)."""
    if interpret:
        return tuple(jnp.dot(_value(a), b[...], preferred_element_type=F32) for a, b, _ in specs)

    def scoped(*accs):
        for acc, (a, b, _) in zip(accs, specs):
            plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)

    return lax.optimization_barrier(
        pl.run_scoped(scoped, *(plgpu.ACC(shape, F32) for _, _, shape in specs)))


FLAGS = 32  # int32 per chunk: TMA writes shared memory at 128-byte aligned addresses


def _flags(doc, first, last):
    """doc, first, last [B, NC] -> [B, NC, 32] int32, zero padded: one 128-byte TMA copy per
    chunk into a slot of a [2, 32] buffer (a 16-byte slot put the second slot off the 128-byte
    alignment TMA needs: CUDA_ERROR_MISALIGNED_ADDRESS on the H200, not seen in interpret
    mode)."""
    flags = jnp.stack([doc, first, last], axis=-1).astype(jnp.int32)
    return jnp.pad(flags, [(0, 0), (0, 0), (0, FLAGS - 3)])


def _doc_states(x):
    """[N, H, K, V] <-> [N, H, V, K] float32."""
    return jnp.swapaxes(x, -1, -2).astype(F32)


class Profile(NamedTuple):
    """Mosaic GPU's profiler settings: traces into ``directory``, ``ranges`` a warpgroup."""
    directory: str
    ranges: int


# the kernels built inside ``profiled`` record the regions of their ``jax.named_scope``s
_PROFILE = TraceDefaults("profiled", Profile, None)


@contextlib.contextmanager
def profiled(directory: str, ranges: int = 512):
    """Kernels lowered inside record each ``jax.named_scope`` region's start and end per
    warpgroup (at most ``ranges`` a warpgroup, later ones dropped) into a Perfetto trace in
    ``directory``, one file a lowered kernel (named at lowering) holding its first execution's
    events: later executions find the file there and are not kept (GPU only; interpret mode
    ignores it). The events wait in shared memory, 16 bytes a range a warpgroup, on top of the
    kernel's own. JAX's caches are cleared on entry and on exit: a lowering cached outside (an
    op's kernels are lowered once a program, ``partition.lowered_once``) would not record, and
    one made inside would record outside."""
    jax.clear_caches()
    try:
        with _PROFILE.use(Profile(directory, ranges)):
            yield
    finally:
        jax.clear_caches()


def kernel(body, *, name, out_type, scratch, grid, interpret, grid_names=("b", "h", "v"),
           warpgroups=1, auto_barriers=True):
    """``plgpu.kernel`` as every Mosaic kernel of this package calls it: approximate exp and
    division, the interpreter on a CPU (``interpret``), ``warpgroups`` named "wg" when two.
    ``auto_barriers=False``: Pallas inserts no warpgroup barrier around shared-memory loads and
    stores (it puts one before and one after each store otherwise); the body synchronises its
    threads itself (``plgpu.commit_smem``) wherever one reads what another wrote. Inside
    ``profiled`` (and not ``interpret``) the profiler records the body's named scopes."""
    threads = dict(num_threads=warpgroups, thread_name="wg") if warpgroups > 1 else {}
    p = None if interpret else _PROFILE.current
    profile = {} if p is None else dict(profile_dir=p.directory, profile_space=p.ranges,
                                        profile_bounds_check=True)
    params = plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=not auto_barriers,
                                  **profile)
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
        compiler_params=params, **threads,
        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)


def _issue_shared(c, slot, bar, position, W, kw, values, gc, flags):
    """TMA copies of chunk ``c``'s tiles that both passes read, each a (GMEM ref, SMEM buffer)
    pair, into ``slot``: the W and K̃' rows, a value tile (U or A), Γ_C and the flags."""
    b, h, v0 = position
    rows = pl.ds(c * C, C)
    for src, dst in ((W[0].at[b, h, rows], W[1]), (kw[0].at[b, h, rows], kw[1]),
                     (values[0].at[b, h, rows, pl.ds(v0, BV)], values[1]),
                     (gc[0].at[b, h, c], gc[1]), (flags[0].at[b, c], flags[1])):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], bar)


def bcast_rows(vec, shape):
    """vec (ROWS layout) broadcast along each row of a tile of ``shape``."""
    return lax.broadcast_in_dim(vec, shape, [0])


def bcast_cols(vec, shape):
    """vec (COLS layout) broadcast along each column of a tile of ``shape``."""
    return lax.broadcast_in_dim(vec, shape, [1])


@functools.cache
def _untiled_load(shape, dtype, layout):
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct(shape, dtype, layout=layout))
    def load(ctx, ref):
        del ctx
        return mgpu.FragmentedArray.load_untiled(ref, layout=layout.to_mgpu(), optimized=False)
    return load


@functools.cache
def _untiled_store(layout):
    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()))
    def store(ctx, x, ref):
        del ctx
        x.store_untiled(ref, optimized=False)
    return store


def read(ref, interpret, layout=WGMMA):
    """A shared-memory buffer without transforms (or a slice of one: any row offset) in
    registers in ``layout``, read in an ``inline_mgpu`` block. Through ``plgpu.load``, several
    reads and writes of one buffer send Pallas's layout inference into a search that runs out
    of fuel after ten minutes; Mosaic's own load is opaque to it."""
    if interpret:
        return ref[...]
    return _untiled_load(tuple(ref.shape), jnp.dtype(ref.dtype), layout)(ref)


def write(ref, x, interpret, layout=WGMMA):
    """``ref[...] = x`` for a buffer as ``read`` takes it, x in ``layout``."""
    if interpret:
        ref[...] = x
    else:
        _untiled_store(layout)(x, ref)


def tile_iotas():
    """Row and column indices i, j of a [C, C] tile in the WGMMA layout."""
    return tuple(plgpu.broadcasted_iota(jnp.int32, (C, C), d, layout=WGMMA) for d in (0, 1))


def decay_matrix(i, j, g_row, g_col):
    """D_ij = exp(G_i − G_j) for i >= j, else 0 ([C, C]; the in-chunk cumsum G by rows and by
    columns; the exponent masked first, so no entry overflows)."""
    sq = (C, C)
    return jnp.exp(jnp.where(i >= j, bcast_rows(g_row, sq) - bcast_cols(g_col, sq), -jnp.inf))


def columns(buf, slot):
    """Slot ``slot`` of the per-chunk vector buffer ``buf`` (one value per column: Γ_C by key,
    or a row vector by chunk row), loaded once and broadcast over the BV rows of a transposed
    tile."""
    vec = plgpu.load(buf.at[slot], layout=COLS)
    return bcast_cols(vec, (BV, vec.shape[0]))


def _loop(nc, reverse, issue, in_bar, step, K, released=None):
    """The chunk loop: chunk tiles double-buffered (slot i % 2), the next chunk's issued right
    after the current one's arrive; ``step(c, slot, carry)`` returns the next carry, the
    transposed [BV, K] float32 state or cotangent, zeros before the first chunk.
    ``released``: a barrier another warpgroup arrives on once done with a chunk's slot, waited
    for before every step but the first (the other slot is refilled then)."""
    chunk_at = (lambda i: nc - 1 - i) if reverse else (lambda i: i)
    issue(chunk_at(0), 0)

    def body(i, carry):
        slot = lax.rem(i, 2)
        plgpu.barrier_wait(in_bar.at[slot])
        if released is not None:
            @pl.when(i > 0)
            def _released():
                plgpu.barrier_wait(released)

        @pl.when(i + 1 < nc)
        def _prefetch():
            plgpu.commit_smem()  # this thread's reads of the other slot are done
            issue(chunk_at(i + 1), 1 - slot)

        return step(chunk_at(i), slot, carry)

    zero = plgpu.layout_cast(jnp.zeros((BV, K), F32), WGMMA)
    carry = lax.fori_loop(0, nc, body, zero)
    plgpu.wait_smem_to_gmem(0)
    return carry


def _start(doc_buf):
    """This CTA's (b, h, first value column), after filling ``doc_buf``, the float32 [BV, K]
    document-state buffer, with zeros: the chunks a pass meets before its first document
    boundary (the backward's trailing layout padding) read it times 0, which must not be
    garbage times 0."""
    doc_buf[...] = plgpu.layout_cast(jnp.zeros(doc_buf.shape, F32), WGMMA)
    plgpu.commit_smem()
    return lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v") * BV


def _doc_state_in(ref, doc, h, v0, buf, bar, cond):
    """Load document ``doc``'s transposed state tile into ``buf`` when ``cond``; return ``buf``'s
    value (times 0 where ``cond`` fails: it then holds an earlier finite tile, or zeros). The
    one buffer serves ``_doc_state_out`` too, so its pending store is waited for first."""
    @pl.when(cond != 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(ref.at[doc, h, pl.ds(v0, BV)], buf, bar)
        plgpu.barrier_wait(bar)

    return plgpu.load(buf, layout=WGMMA)


def _doc_state_out(value, ref, doc, h, v0, buf, cond):
    """Store ``value`` (transposed tile, float32) as document ``doc``'s state when ``cond``."""
    @pl.when(cond != 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # buf's previous store was read
        buf[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, ref.at[doc, h, pl.ds(v0, BV)])


def restart_state(S, init_ref, d, h, v0, doc, is_first):
    """A forward step's carry at chunk ``c``: 0, or document ``d``'s initial state (``init_ref``
    None: no initial states) loaded through ``doc`` = (buffer, barrier), at its first chunk."""
    S = S * (1 - is_first).astype(F32)
    if init_ref is None:
        return S
    return S + _doc_state_in(init_ref, d, h, v0, *doc, is_first) * is_first.astype(F32)


def restart_cotangent(dS, dinit_ref, d, h, v0, buf, is_first):
    """A backward step's carry after chunk ``c``: dS stored as document ``d``'s dS_0 at its
    first chunk, where the carry restarts at 0."""
    _doc_state_out(dS, dinit_ref, d, h, v0, buf, is_first)
    return dS * (1 - is_first).astype(F32)


def state_fwd(W, U, kw, gc, initial_state, doc, first, last, *, num_docs, interpret, store=True,
              output=None):
    """Forward pass. Returns a list: if ``store``, the chunk-start states [B, H, NC, V, K]
    (transposed) and R = U − W S [B, H, Tp, V], both bf16; the final states [N, H, K, V]
    float32; with ``output`` = (q, P, scale, out_dtype) (Q' [B, H, Tp, K], P [B, H, Tp, C],
    16-bit) also o = scale (Q' S + P R) [B, Tp, H, V] in 16-bit ``out_dtype``, formed in the
    pass (two more wgmmas a chunk, off the carry's path). ``initial_state``: None or
    [N, H, K, V]; ``num_docs``: N, or None for one document per batch row. Output tiles go out
    through single shared-memory buffers (a chunk step's stores are read long before the next
    step writes them; the wait is there all the same)."""
    B, H, Tp, K = W.shape
    V, nc = U.shape[-1], Tp // C
    check_shapes(chunk=Tp // gc.shape[2], K=K, V=V)
    N, has_init = B if num_docs is None else num_docs, initial_state is not None
    ins = (W, U, kw, gc, initial_state) + (output[:2] if output is not None else ())
    out_type = [out_struct((N, H, V, K), F32, *ins)]
    scratch = dict(w=smem((2, C, K), BF16), k=smem((2, C, K), BF16), u=smem((2, C, BV), BF16),
                   g=plgpu.SMEM((2, K), F32), fl=plgpu.SMEM((2, FLAGS), jnp.int32),
                   doc_buf=plgpu.SMEM((BV, K), F32), doc_bar=plgpu.Barrier())
    if store:
        out_type[:0] = [out_struct((B, H, nc, V, K), BF16, *ins),
                        out_struct((B, H, Tp, V), BF16, *ins)]
        scratch.update(s_out=smem((BV, K), BF16), r_out=smem((C, BV), BF16))
    args = [W, U, kw, gc, _flags(doc, first, last)]
    if output is not None:
        q, P, scale, out_dtype = output
        out_type.append(out_struct((B, Tp, H, V), out_dtype, *ins))
        scratch.update(q=smem((2, C, K), BF16), p=smem((2, C, C), BF16),
                       o_out=smem((C, BV), out_dtype))
        args += [q, P]
    scratch["in_bar"] = plgpu.Barrier(num_arrivals=5 + 2 * (output is not None), num_barriers=2)
    args += [_doc_states(initial_state)] if has_init else []

    def body(*refs, w, k, u, g, fl, doc_buf, doc_bar, in_bar, s_out=None, r_out=None, q=None,
             p=None, o_out=None):
        refs = list(refs)
        W_ref, U_ref, kw_ref, gc_ref, f_ref = (refs.pop(0) for _ in range(5))
        q_ref, P_ref = (refs.pop(0), refs.pop(0)) if output is not None else (None, None)
        init_ref = refs.pop(0) if has_init else None
        states_ref, R_ref = (refs.pop(0), refs.pop(0)) if store else (None, None)
        final_ref = refs.pop(0)
        o_ref = refs.pop(0) if output is not None else None
        b, h, v0 = _start(doc_buf)

        def issue(c, slot):
            rows, bar = pl.ds(c * C, C), in_bar.at[slot]
            _issue_shared(c, slot, bar, (b, h, v0), (W_ref, w), (kw_ref, k), (U_ref, u),
                          (gc_ref, g), (f_ref, fl))
            if output is not None:
                plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q.at[slot], bar)
                plgpu.copy_gmem_to_smem(P_ref.at[b, h, rows], p.at[slot], bar)

        def step(c, slot, S):
            d, is_first, is_last = fl[slot, 0], fl[slot, 1], fl[slot, 2]
            rows = pl.ds(c * C, C)
            S = restart_state(S, init_ref, d, h, v0, (doc_buf, doc_bar), is_first)
            s_lo = S.astype(BF16)
            u_t = plgpu.load(u.at[slot].T, layout=WGMMA).astype(F32)
            r_t = matmul([(-s_lo, w.at[slot].T)], (BV, C), u_t, interpret)  # Rᵀ = Uᵀ − Sᵀ Wᵀ
            r_lo = r_t.astype(BF16)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's stores were read
            if store:
                s_out[...] = s_lo
                r_out.T[...] = r_lo
            if output is not None:  # Oᵀ = scale (Sᵀ Q'ᵀ + Rᵀ Pᵀ)
                o_t = matmul([(s_lo, q.at[slot].T), (r_lo, p.at[slot].T)], (BV, C), None,
                             interpret)
                o_out.T[...] = (scale * o_t).astype(o_out.dtype)
            plgpu.commit_smem()
            if store:
                plgpu.copy_smem_to_gmem(s_out, states_ref.at[b, h, c, pl.ds(v0, BV)],
                                        commit_group=False)
                plgpu.copy_smem_to_gmem(r_out, R_ref.at[b, h, rows, pl.ds(v0, BV)],
                                        commit_group=False)
            if output is not None:
                plgpu.copy_smem_to_gmem(o_out, o_ref.at[b, rows, h, pl.ds(v0, BV)],
                                        commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            decay = columns(g, slot)
            S = matmul([(r_lo, k.at[slot])], (BV, K), S * decay, interpret)  # Sᵀ Γ_C + Rᵀ K̃'
            _doc_state_out(S, final_ref, d, h, v0, doc_buf, is_last)
            return S

        _loop(nc, False, issue, in_bar, step, K)

    outs = list(kernel(body, name="state_fwd_mosaic", out_type=tuple(out_type), scratch=scratch,
                        grid=(B, H, V // BV), interpret=interpret)(*args))
    outs[2 * store] = _doc_states(outs[2 * store])
    return outs


def store_cotangents(ds_lo, dr_lo, bufs, refs, position, c, *, pending):
    """A backward step's stores of chunk ``c``: dS_C (transposed) and dR through the shared
    buffers ``bufs`` into ``refs`` = (chunk-end cotangents, dU), once at most ``pending`` earlier
    stores are still being read (those of the buffers' previous chunk are not)."""
    (ds_buf, du_buf), (dstates_ref, dU_ref), (b, h, v0) = bufs, refs, position
    plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
    ds_buf[...] = ds_lo
    du_buf.T[...] = dr_lo
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ds_buf, dstates_ref.at[b, h, c, pl.ds(v0, BV)], commit_group=False)
    plgpu.copy_smem_to_gmem(du_buf, dU_ref.at[b, h, pl.ds(c * C, C), pl.ds(v0, BV)],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()


def state_bwd(W, kw, gc, A, G, dfinal, doc, first, last, *, interpret, products=None):
    """Backward pass: dU = dR [B, H, Tp, V] and the chunk-end cotangents dS_C [B, H, NC, V, K]
    (transposed), both bf16; dS_0 [N, H, K, V] float32. A = scale Pᵀ dO [B, H, Tp, V] bf16;
    G = scale (Q'ᵀ dO)ᵀ [B, H, NC, V, K] (transposed) bf16, or None with ``products`` =
    (q, do, scale) (Q' [B, H, Tp, K] and dO [B, Tp, H, V], 16-bit): the pass adds Gᵀ = (scale
    dO)ᵀ Q' itself, a third wgmma a chunk into the accumulator of − dRᵀ W (scale dO rounded to
    bf16, as jax-linear-attention does; no G through HBM); dfinal [N, H, K, V]."""
    B, H, Tp, K = W.shape
    V, nc, N = A.shape[-1], Tp // C, dfinal.shape[0]
    check_shapes(chunk=Tp // gc.shape[2], K=K, V=V)
    ins = (W, kw, gc, A, G, dfinal) + (products[:2] if products is not None else ())
    out_type = (out_struct((B, H, Tp, V), BF16, *ins), out_struct((B, H, nc, V, K), BF16, *ins),
                out_struct((N, H, V, K), F32, *ins))
    scratch = dict(w=smem((2, C, K), BF16), k=smem((2, C, K), BF16), a=smem((2, C, BV), BF16),
                   g=plgpu.SMEM((2, K), F32), fl=plgpu.SMEM((2, FLAGS), jnp.int32),
                   ds_out=smem((2, BV, K), BF16), du_out=smem((2, C, BV), BF16),
                   doc_buf=plgpu.SMEM((BV, K), F32), doc_bar=plgpu.Barrier(),
                   in_bar=plgpu.Barrier(num_arrivals=6 + (products is not None), num_barriers=2))
    args = [W, kw, gc, A, _flags(doc, first, last), _doc_states(dfinal)]
    if products is None:
        scratch["gt"] = smem((2, BV, K), BF16)
        args.append(G)
    else:
        q, do, scale = products
        scratch.update(q=smem((2, C, K), BF16), do=smem((2, C, BV), do.dtype))
        args += [q, do]

    def body(W_ref, kw_ref, gc_ref, A_ref, f_ref, dfinal_ref, *refs, w, k, a, g, fl, ds_out,
             du_out, doc_buf, doc_bar, in_bar, gt=None, q=None, do=None):
        refs = list(refs)
        G_ref = refs.pop(0) if products is None else None
        q_ref, do_ref = (refs.pop(0), refs.pop(0)) if products is not None else (None, None)
        dU_ref, dstates_ref, dinit_ref = refs
        b, h, v0 = _start(doc_buf)

        def issue(c, slot):
            rows, bar = pl.ds(c * C, C), in_bar.at[slot]
            _issue_shared(c, slot, bar, (b, h, v0), (W_ref, w), (kw_ref, k), (A_ref, a),
                          (gc_ref, g), (f_ref, fl))
            if products is None:
                plgpu.copy_gmem_to_smem(G_ref.at[b, h, c, pl.ds(v0, BV)], gt.at[slot], bar)
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q.at[slot], bar)
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h, pl.ds(v0, BV)], do.at[slot], bar)

        def step(c, slot, dS):
            d, is_first, is_last = fl[slot, 0], fl[slot, 1], fl[slot, 2]
            dS = dS * (1 - is_last).astype(F32) + _doc_state_in(
                dfinal_ref, d, h, v0, doc_buf, doc_bar, is_last) * is_last.astype(F32)
            ds_lo = dS.astype(BF16)
            a_t = plgpu.load(a.at[slot].T, layout=WGMMA).astype(F32)
            dr_t = matmul([(ds_lo, k.at[slot].T)], (BV, C), a_t, interpret)  # dRᵀ = Aᵀ + dSᵀ K̃'ᵀ
            dr_lo = dr_t.astype(BF16)
            store_cotangents(ds_lo, dr_lo, (ds_out.at[slot], du_out.at[slot]),
                             (dstates_ref, dU_ref), (b, h, v0), c, pending=1)
            decay = columns(g, slot)
            if products is None:  # dS Γ_C + Gᵀ − dRᵀ W
                g_t = plgpu.load(gt.at[slot], layout=WGMMA).astype(F32)
                dS = matmul([(-dr_lo, w.at[slot])], (BV, K), dS * decay + g_t, interpret)
            else:
                do_t = (scale * plgpu.load(do.at[slot].T, layout=WGMMA).astype(F32)).astype(BF16)
                dS = matmul([(-dr_lo, w.at[slot]), (do_t, q.at[slot])], (BV, K), dS * decay,
                            interpret)
            return restart_cotangent(dS, dinit_ref, d, h, v0, doc_buf, is_first)

        _loop(nc, True, issue, in_bar, step, K)

    return backward_call(body, "state_bwd_mosaic", out_type, scratch, (B, H, V // BV),
                         interpret, args)


def backward_call(body, name, out_type, scratch, grid, interpret, args):
    """A backward pass's kernel call: dU, dS_C and the document states' cotangents dS_0
    [N, H, K, V] (untransposed)."""
    dU, dstates, dinit = kernel(body, name=name, out_type=out_type, scratch=scratch, grid=grid,
                                 interpret=interpret)(*args)
    return dU, dstates, _doc_states(dinit)
