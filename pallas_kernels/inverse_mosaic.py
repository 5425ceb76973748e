"""The WY step's inverse on the tensor cores (Mosaic GPU, wgmma; Hopper): ``wy_triton.wy_inverse``'s
results for chunks of 64, K in {64, 128}, bf16 inputs, no or a scalar decay.

For each (batch row, head, chunk), from q, k, k̃ [C, K] and the rows β, γ (the in-chunk cumsum
of the log decays, from XLA), with D_ij = exp(γ_i − γ_j) (i >= j, else 0):

    A = K K̃ᵀ ⊙ D     L = strict_tril(Diag(β) A)     P = (Q K̃ᵀ) ⊙ D
    T = (I + L)^-1:  X_16 = the inverses of the 16x16 diagonal blocks of I + L, by forward
                     substitution in float32 (``diagonal_inverse``), then the block merges
                     X_2n = X_n − X_n (L_n X_n) for n = 16, 32

(P only when q is given: by default the state passes form it, ``wy_inverse_rows``; L_n holds
L's entries below the diagonal n-blocks of each 2n-block; jax-linear-attention's and
FlashQLA's ``kkt_solve`` split the inverse the same way). The grams take the bf16 inputs as
they are (exact products, float32 sums). Each merge product is three bf16 wgmmas over hi / lo
splits of its float32 operands, a_hi b_hi + a_hi b_lo + a_lo b_hi (``split_product``: ~2^-16
relative, against tf32's 2^-11 in the Triton kernel; one bf16 pass would put T's error at ~5e-3
for keys sharing a direction, benchmarks/NOTES.md sessions 14-15); ``passes=2`` splits L's side only;
``passes=1`` is one bf16 wgmma of the rounded operands (jax-linear-attention's ``kkt_fwd``:
the forward 0.162 -> 0.133 ms at 8x2048x8x128, but past FLA's bars with keys sharing a
direction, RESULTS run 153; two passes, the op's default, kept the op's bf16 errors of
three there, runs 154-155). T and P are stored in bf16.

A CTA walks ``chunks_per_cta`` consecutive chunks: once a chunk's two grams are formed, its
input tiles are free and the next chunk's loads fly while this one's inverse is solved; the
stores of T and P are left in flight until the next chunk's results are staged. ~109 KB of
shared memory at K = 128: two CTAs an SM.

As in ``state_mosaic``, wgmma has no CPU lowering in jax 0.11.2: in interpret mode the products
run as ``jnp.dot`` of the same bf16 operands, and the substitution (an ``inline_mgpu`` block,
which the interpreter cannot run) as the same recurrence in jnp (``_diagonal_inverse_jnp``).
"""

import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mlir.dialects import math as mlir_math

from pallas_kernels.sequence_split import SMS
from pallas_kernels.state_mosaic import (BF16, C, COLS, F32, ROWS, bcast_rows, decay_matrix,
                                         kernel, matmul, products, smem, tile_iotas)
from pallas_kernels.triton_common import out_struct

BLOCK = 16  # rows of the diagonal blocks solved by substitution
PAD = 8  # float32 padding of the substitution buffers' rows (unpadded, the WGMMA layout's
#          stores of 8 rows at a 256-byte stride hit one bank 8 times; jla measured 30 %)


def split_bf16(x):
    """(hi, lo) bf16 parts of a float32 tile, x = hi + lo to ~2^-16 relative."""
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


def split_product(a, b, b_hi, b_lo, interpret, split_a=True, split_b=True):
    """a @ b of float32 register tiles ([C, C] @ [C, n]) by bf16 wgmmas over hi / lo parts:
    a_hi b_hi + a_hi b_lo + a_lo b_hi (a_lo b_lo, ~2^-16 relative, left out); an operand not
    split (``split_a`` / ``split_b`` False) is rounded to bf16 once and its lo terms drop. b is
    staged in the buffers b_hi (and b_lo)."""
    b_parts = split_bf16(b) if split_b else (b.astype(BF16),)
    for buf, part in zip((b_hi, b_lo), b_parts):
        buf[...] = part
    plgpu.commit_smem()
    a_hi, a_lo = split_bf16(a) if split_a else (a.astype(BF16), None)
    terms = [(a_hi, b_hi)] + [(a_hi, b_lo)] * split_b + [(a_lo, b_hi)] * split_a
    return matmul(terms, (C, b.shape[1]), None, interpret)


@plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()),
    return_type=plgpu.ShapeDtypeStruct((C, C), F32, layout=plgpu.Layout.WGMMA))
def _diagonal_inverse_mgpu(ctx, neg_l, l_ref, x_ref):
    """``diagonal_inverse`` on the CUDA cores: −L is staged in ``l_ref`` and thread r < C solves
    row r of its block's inverse right-looking, t = e_r, for m = 15 .. 0 (block-local):
    X_rm = t_m, then t_j += (−L_mj) X_rm for j < m. The threads of a block read the same row m
    of −L at each step (broadcast 16-byte loads); the chain is one FMA a step. Both buffers are
    touched only here, so Pallas's layout inference never sees them."""
    del ctx
    f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
    vec4, cst = ir.VectorType.get([4], f32), mgpu_utils.c
    zero, one = cst(0.0, f32), cst(1.0, f32)
    neg_l.store_untiled(l_ref, optimized=False)
    mgpu.FragmentedArray.splat(zero, (C, C), layout=mgpu.WGMMA_LAYOUT).store_untiled(
        x_ref, optimized=False)  # X outside the diagonal blocks
    mgpu_utils.warpgroup_barrier()  # −L and the zeros visible to every thread
    tid = arith.remui(mgpu_utils.thread_idx(), cst(128, i32))
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, tid, cst(C, i32))):
        row = arith.index_cast(index, tid)
        local = arith.remui(tid, cst(BLOCK, i32))
        start = arith.index_cast(index, arith.subi(tid, local))
        at = lambda m: arith.addi(start, cst(m, index))  # noqa: E731
        t = {j: arith.select(arith.cmpi(arith.CmpIPredicate.eq, local, cst(j, i32)), one, zero)
             for j in range(BLOCK)}
        for m in reversed(range(BLOCK)):
            x_m = t.pop(m)
            memref.store(x_m, x_ref, [row, at(m)])
            for j0 in range(0, m, 4):
                seg = vector.load(vec4, l_ref, [at(m), at(j0)])
                for jj in range(min(4, m - j0)):
                    a = vector.extract(seg, dynamic_position=[],
                                       static_position=ir.DenseI64ArrayAttr.get([jj]))
                    t[j0 + jj] = mlir_math.fma(a, x_m, t[j0 + jj])
    mgpu_utils.warpgroup_barrier()  # every row written before X is read
    return mgpu.FragmentedArray.load_untiled(x_ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)


def _diagonal_inverse_jnp(neg_l):
    """``_diagonal_inverse_mgpu``'s recurrence as jnp ops on a [C, C] array (interpret mode)."""
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    start = i - i % BLOCK
    t, X = (i == j).astype(F32), jnp.zeros((C, C), F32)
    for m in reversed(range(BLOCK)):
        x_m = jnp.take_along_axis(t, start + m, axis=1)
        X = X + jnp.where(j == start + m, x_m, 0.0)
        t = t + jnp.where((j >= start) & (j < start + m), neg_l[start[:, 0] + m] * x_m, 0.0)
    return X


def diagonal_inverse(L, l_buf, x_buf, interpret):
    """The inverses of the 16x16 diagonal blocks of I + L (L strictly lower, float32 [C, C]
    registers), zero elsewhere, by forward substitution in float32 (``l_buf``, ``x_buf``:
    [C, C + PAD] float32 scratch)."""
    i, j = tile_iotas()
    neg_l = jnp.where(lax.div(i, BLOCK) == lax.div(j, BLOCK), -L, 0.0)
    if interpret:
        return _diagonal_inverse_jnp(neg_l)
    return _diagonal_inverse_mgpu(neg_l, l_buf.at[:, :C], x_buf.at[:, :C])


def unit_lower_inverse(L, hi, lo, l_buf, x_buf, interpret, passes=3):
    """(I + L)^-1 of a strictly lower-triangular float32 [C, C] register tile: the 16x16
    diagonal blocks by ``diagonal_inverse``, then the merges X_2n = X_n − X_n (L_n X_n) for
    n = 16, 32 (module docstring), each product a ``split_product`` through hi, lo in
    ``passes`` bf16 wgmmas: 3, both factors split; 2, L_n and L_n X split and X rounded once (on
    the CPU tests' inputs 93 % of T's elements round to float64's bf16 bits, against 97 % with
    3, 86 % with 1 and 87 % splitting X instead); 1, nothing split."""
    if passes not in (1, 2, 3):
        raise ValueError(f"passes must be 1, 2 or 3 (bf16 wgmmas a merge product), got {passes!r}")
    i, j = tile_iotas()
    X = diagonal_inverse(L, l_buf, x_buf, interpret)
    for size in (BLOCK, 2 * BLOCK):
        Ln = jnp.where((lax.div(i, 2 * size) == lax.div(j, 2 * size))
                       & (lax.div(i, size) != lax.div(j, size)), L, 0.0)
        link = split_product(Ln, X, hi, lo, interpret, split_a=passes >= 2, split_b=passes == 3)
        X = X - split_product(X, link, hi, lo, interpret, split_a=passes == 3,
                              split_b=passes >= 2)
    return X


def chunks_per_cta(B, H, nc, sms=SMS):
    """The most chunks a CTA (up to 8, dividing ``nc``) that keep >= 1.5 CTAs an SM busy
    (jax-linear-attention's rule for its kkt kernel): several chunks a CTA hide the loads, too
    few CTAs leave SMs idle."""
    for n in (8, 4, 2):
        if nc % n == 0 and B * H * (nc // n) * 2 >= 3 * sms:
            return n
    return 1


def inverse(q, k, kw, beta, gamma, *, interpret, chunks=None, passes=3):
    """T = (I + L)^-1 and P [B, H, Tp, C] bf16 (module docstring) of q, k, kw [B, Tp, H, K]
    (bf16), beta and gamma (the in-chunk cumsum of the log decays, zeros without a decay)
    [B, H, Tp] float32; q None: T alone (P None: the state passes form it). ``chunks``: chunks
    a CTA (None: ``chunks_per_cta``); ``passes``: bf16 wgmmas a merge product
    (``unit_lower_inverse``)."""
    B, Tp, H, K = k.shape
    nc, with_p = Tp // C, q is not None
    cpc = chunks_per_cta(B, H, nc) if chunks is None else chunks
    if nc % cpc:
        raise ValueError(f"chunks ({cpc}) must divide the {nc} chunks of a row")
    ins = (q, k, kw, beta, gamma) if with_p else (k, kw, beta, gamma)
    out_type = tuple(out_struct((B, H, Tp, C), BF16, *ins) for _ in range(1 + with_p))
    vec, pad = plgpu.SMEM((C,), F32), plgpu.SMEM((C, C + PAD), F32)
    scratch = dict(k=smem((C, K), BF16), kw=smem((C, K), BF16),
                   b=vec, g_r=vec, g_c=vec, hi=smem((C, C), BF16), lo=smem((C, C), BF16),
                   l_buf=pad, x_buf=pad, bar=plgpu.Barrier(num_arrivals=5 + with_p))
    if with_p:
        scratch.update(q=smem((C, K), BF16), p_out=smem((C, C), BF16))
    sq = (C, C)

    def body(*refs, k, kw, b, g_r, g_c, hi, lo, l_buf, x_buf, bar, q=None, p_out=None):
        refs = list(refs)
        q_ref = refs.pop(0) if with_p else None
        k_ref, kw_ref, b_ref, g_ref, T_ref = refs[:5]
        P_ref = refs[5] if with_p else None
        bi, h, first = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c") * cpc

        def issue(c):
            rows = pl.ds(c * C, C)
            copies = [(k_ref.at[bi, rows, h], k), (kw_ref.at[bi, rows, h], kw),
                      (b_ref.at[bi, h, rows], b), (g_ref.at[bi, h, rows], g_r),
                      (g_ref.at[bi, h, rows], g_c)]
            for src, dst in copies + ([(q_ref.at[bi, rows, h], q)] if with_p else []):
                plgpu.copy_gmem_to_smem(src, dst, bar)

        issue(first)
        i, j = tile_iotas()

        @pl.loop(0, cpc)
        def _chunk(n):
            c = first + n
            rows = pl.ds(c * C, C)
            plgpu.barrier_wait(bar)
            beta_r = plgpu.load(b, layout=ROWS)
            D = decay_matrix(i, j, plgpu.load(g_r, layout=ROWS), plgpu.load(g_c, layout=COLS))
            gram, *qk = products([(k, kw.T, sq)] + ([(q, kw.T, sq)] if with_p else []),
                                 interpret)

            @pl.when(n + 1 < cpc)
            def _next():  # the tiles were read (the vectors before the wgmmas' wait)
                plgpu.commit_smem()
                issue(c + 1)

            L = jnp.where(i > j, bcast_rows(beta_r, sq) * gram * D, 0.0)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's T, P were sent
            if with_p:
                p_out[...] = (qk[0] * D).astype(BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(p_out, P_ref.at[bi, h, rows])
            X = unit_lower_inverse(L, hi, lo, l_buf, x_buf, interpret, passes)
            hi[...] = X.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(hi, T_ref.at[bi, h, rows])

        plgpu.wait_smem_to_gmem(0)

    outs = kernel(body, name="wy_inverse_mosaic", out_type=out_type, scratch=scratch,
                  grid=(B, H, nc // cpc), interpret=interpret,
                  grid_names=("b", "h", "c"))(*ins)
    return (outs[0], outs[1] if with_p else None)


def _heads(x):
    """[B, Tp, H] -> [B, H, Tp] float32."""
    return jnp.moveaxis(x, 2, 1).astype(F32)


def _rows(beta, gamma, sigma, K):
    """Γ_C [B, H, NC, K] and the rows β, βΓ, Γ, Γ_C/Γ [B, H, 4, Tp] from β, γ, σ [B, H, Tp]."""
    B, H, Tp = beta.shape
    Gam = jnp.exp(gamma)
    gc = jnp.broadcast_to(Gam.reshape(B, H, Tp // C, C)[..., -1:], (B, H, Tp // C, K))
    return gc, jnp.stack([beta, beta * Gam, Gam, jnp.exp(sigma)], axis=2)


def wy_inverse(q, k, kw, beta, gamma, sigma, *, interpret, passes=3):
    """``wy_triton.wy_inverse``'s results (P, Γ_C [B, H, NC, K], T, rows β, βΓ, Γ, Γ_C/Γ
    [B, H, 4, Tp]) with T and P from ``inverse`` (its ``passes``), from the in-chunk sums γ, σ
    of the log decays [B, Tp, H] (``delta_rule._decay_sums``; zeros without a decay)."""
    beta, gamma, sigma = _heads(beta), _heads(gamma), _heads(sigma)
    T, P = inverse(q, k, kw, beta, gamma, interpret=interpret, passes=passes)
    gc, vecs = _rows(beta, gamma, sigma, k.shape[-1])
    return P, gc, T, vecs


def wy_inverse_rows(k, kw, beta, gamma, sigma, *, interpret, passes=3):
    """``wy_inverse`` without P (the state passes form it from q, k̃ and γ): Γ_C, T and the
    rows β, βΓ, Γ, Γ_C/Γ, γ [B, H, 5, Tp]."""
    beta, gamma, sigma = _heads(beta), _heads(gamma), _heads(sigma)
    T, _ = inverse(None, k, kw, beta, gamma, interpret=interpret, passes=passes)
    gc, vecs = _rows(beta, gamma, sigma, k.shape[-1])
    return gc, T, jnp.concatenate([vecs, gamma[:, :, None]], axis=2)
