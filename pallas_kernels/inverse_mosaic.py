"""The WY step's inverse on the tensor cores (Mosaic GPU, wgmma; Hopper): ``wy_triton.wy_inverse``'s
results for chunks of 64, K in {64, 128}, bf16 inputs, no or a scalar decay.

One CTA a (batch row, head, chunk) loads q, k, k̃ [C, K] and the rows β, γ (the in-chunk cumsum of
the log decays, from XLA) and forms, with D_ij = exp(γ_i − γ_j) (i >= j, else 0):

    A = K K̃ᵀ ⊙ D     L = strict_tril(Diag(β) A)     P = (Q K̃ᵀ) ⊙ D
    T = (I + L)^-1 by block merges  X_2 = I − L_1,  X_2n = X_n − X_n (L_n X_n)  (n = 2 .. 32)

(``triton_common.unit_lower_inverse``'s merges: L_n holds L's entries below the diagonal
n-blocks of each 2n-block). The grams take the bf16 inputs as they are (exact products, float32
sums). Each merge product is three bf16 wgmmas over hi / lo splits of its float32 operands,
a_hi b_hi + a_hi b_lo + a_lo b_hi (``_product``: ~2^-16 relative, against tf32's 2^-11 in the
Triton kernel; one bf16 pass would put T's error at ~5e-3 for keys sharing a direction,
benchmarks/NOTES.md session 14). T and P are stored in bf16. Γ_C and the row vectors β, βΓ,
Γ, Γ_C/Γ come from XLA (``wy_inverse``).

As in ``state_mosaic``, wgmma has no CPU lowering in jax 0.11.2: in interpret mode the products
run as ``jnp.dot`` of the same bf16 operands.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.state_mosaic import (BF16, C, COLS, F32, ROWS, bcast_rows, decay_matrix,
                                         matmul, smem, tile_iotas)
from pallas_kernels.triton_common import out_struct


def _split(x):
    """(hi, lo) bf16 parts of a float32 tile, x = hi + lo to ~2^-16 relative."""
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


def _product(a, b, b_hi, b_lo, interpret):
    """a @ b [C, C] of float32 register tiles by three bf16 wgmmas (a_hi b_hi + a_hi b_lo +
    a_lo b_hi; a_lo b_lo, ~2^-16 relative, left out), b staged in the buffers b_hi, b_lo."""
    hi, lo = _split(b)
    b_hi[...] = hi
    b_lo[...] = lo
    plgpu.commit_smem()
    a_hi, a_lo = _split(a)
    return matmul([(a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi)], (C, C), None, interpret)


def inverse(q, k, kw, beta, gamma, *, interpret):
    """T = (I + L)^-1 and P [B, H, Tp, C] bf16 (module docstring) of q, k, kw [B, Tp, H, K]
    (bf16), beta and gamma (the in-chunk cumsum of the log decays, zeros without a decay)
    [B, H, Tp] float32."""
    B, Tp, H, K = q.shape
    ins = (q, k, kw, beta, gamma)
    out_type = tuple(out_struct((B, H, Tp, C), BF16, *ins) for _ in range(2))
    vec = plgpu.SMEM((C,), F32)
    scratch = dict(q=smem((C, K), BF16), k=smem((C, K), BF16), kw=smem((C, K), BF16),
                   b=vec, g_r=vec, g_c=vec, hi=smem((C, C), BF16), lo=smem((C, C), BF16),
                   bar=plgpu.Barrier(num_arrivals=6))
    sq = (C, C)

    def body(q_ref, k_ref, kw_ref, b_ref, g_ref, T_ref, P_ref, *, q, k, kw, b, g_r, g_c, hi, lo,
             bar):
        bi, h, c = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c")
        rows = pl.ds(c * C, C)
        for src, dst in ((q_ref.at[bi, rows, h], q), (k_ref.at[bi, rows, h], k),
                         (kw_ref.at[bi, rows, h], kw), (b_ref.at[bi, h, rows], b),
                         (g_ref.at[bi, h, rows], g_r), (g_ref.at[bi, h, rows], g_c)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)
        i, j = tile_iotas()
        D = decay_matrix(i, j, plgpu.load(g_r, layout=ROWS), plgpu.load(g_c, layout=COLS))
        gram = matmul([(k, kw.T)], sq, None, interpret)
        L = jnp.where(i > j, bcast_rows(plgpu.load(b, layout=ROWS), sq) * gram * D, 0.0)
        X = jnp.where(i == j, 1.0, 0.0) - jnp.where(lax.div(i, 2) == lax.div(j, 2), L, 0.0)
        for n in (2, 4, 8, 16, 32):
            Ln = jnp.where((lax.div(i, 2 * n) == lax.div(j, 2 * n))
                           & (lax.div(i, n) != lax.div(j, n)), L, 0.0)
            X = X - _product(X, _product(Ln, X, hi, lo, interpret), hi, lo, interpret)
        P = matmul([(q, kw.T)], sq, None, interpret) * D
        hi[...] = X.astype(BF16)
        lo[...] = P.astype(BF16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(hi, T_ref.at[bi, h, rows])
        plgpu.copy_smem_to_gmem(lo, P_ref.at[bi, h, rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, H, Tp // C),
        grid_names=("b", "h", "c"), compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="wy_inverse_mosaic")(q, k, kw, beta, gamma)


def wy_inverse(q, k, kw, beta, gamma, sigma, *, interpret):
    """``wy_triton.wy_inverse``'s results (P, Γ_C [B, H, NC, K], T, rows β, βΓ, Γ, Γ_C/Γ
    [B, H, 4, Tp]) with T and P from ``inverse``, from the in-chunk sums γ, σ of the log decays
    [B, Tp, H] (``delta_rule._decay_sums``; zeros without a decay)."""
    B, Tp, H, K = q.shape
    heads = lambda x: jnp.moveaxis(x, 2, 1).astype(F32)  # noqa: E731  [B, Tp, H] -> [B, H, Tp]
    beta, gamma, sigma = heads(beta), heads(gamma), heads(sigma)
    T, P = inverse(q, k, kw, beta, gamma, interpret=interpret)
    Gam = jnp.exp(gamma)
    gc = jnp.broadcast_to(Gam.reshape(B, H, Tp // C, C)[..., -1:], (B, H, Tp // C, K))
    return P, gc, T, jnp.stack([beta, beta * Gam, Gam, jnp.exp(sigma)], axis=2)
