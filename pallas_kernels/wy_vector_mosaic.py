"""``wy_vector_triton.wy_vector_fwd`` on the tensor cores (Mosaic GPU, wgmma, TMA; Hopper): the
per-channel (KDA) WY tensors for chunks of 64, K and V in {64, 128}, bf16 inputs.

For each (batch row, head, chunk), from q, k, k̃ [C, K], v [C, V], the rows β and the in-chunk
cumsum γ [C, K] of the log decays (non-increasing down the rows), with e_ij = exp(γ_i − γ_j):

    A_ij = Σ_k k_ik k̃_jk e_ijk    P_ij = Σ_k q_ik k̃_jk e_ijk    (i >= j, else 0)
    L = strict_tril(Diag(β) A)    T = (I + L)^-1                  (``inverse_mosaic``'s merges)
    W = T Diag(β)(K ⊙ Γ)    U = T Diag(β) V    K̃' = K̃ ⊙ exp(γ_C − γ)    Q' = Q ⊙ Γ    Γ_C

The grams take one of three paths per chunk (``lax.cond`` on the chunk's γ, all K channels),
the first whose factors stay within e^``BOUND`` (72, ``wy_vector_triton.FORWARD_BOUND``'s
argument: a kept entry's two factors multiply to at most 1, entries above the diagonal may
overflow to inf and are discarded by the mask):

- whole: every |γ_i − γ_32| <= BOUND: one factored product through row 32, A_ij = Σ_k (k_ik
  e^{γ_ik − γ_32,k}) (k̃_jk e^{γ_32,k − γ_jk}), masked to i >= j;
- halves: every |γ_i − γ_m(i)| <= BOUND, m(i) = 16 or 48 (the middle of i's half): the entries
  across the halves through row 32 (left factors on the lower half's rows, right factors on the
  upper half's: every exponent <= 0), then each half through its middle row;
- exact (any decay; every exponent <= 0): across the halves through row 32, across the halves
  of each half through its row 16 or 48, and the 16x16 diagonal blocks on the CUDA cores in
  float32: for each offset d = 0 .. 15 the row sums Σ_k k_ik k̃_{i−d,k} e_{i,i−d,k} of k̃ and
  γ read d rows up (this path loads them again, into plain buffers with 16 rows of padding in
  front).

The tiles live in swizzled shared memory, read into registers and written back (the outputs,
in place) by tiled transfers free of bank conflicts; γ's rows 16, 32, 48 (the pivots) and 63
(Γ_C) come in a small plain buffer of their own.

At the bench's layer gates 65 % of chunks take the whole path, 34 % the halves, 0.3 % the exact
one (CPU count).

Each factored product takes its float32 operands as bf16 hi / lo parts, three wgmmas
(``inverse_mosaic.split_product``, ~2^-16 relative: one bf16 pass would round each factor to
2^-9, and T amplifies A's error where keys share a direction); so do W and U. P and the scaled
inputs are stored in bf16, Γ_C in float32 and T in float32 or bf16 (for the Triton pullback
``wy_vector_triton.wy_vector_bwd`` or ``wy_vector_pullback_mosaic``), in
``wy_vector_triton.wy_vector_fwd``'s layouts.

As in ``state_mosaic``, wgmma has no CPU lowering in jax 0.11.2: in interpret mode the products
run as ``jnp.dot`` of the same bf16 operands (and the substitution as jnp ops).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grads_mosaic import shape_problem
from pallas_kernels.inverse_mosaic import PAD, split_bf16, split_product, unit_lower_inverse
from pallas_kernels.state_mosaic import (BF16, C, COLS, F32, ROWS, WGMMA, bcast_cols, bcast_rows,
                                         kernel, matmul, read, smem, tile_iotas, write)
from pallas_kernels.triton_common import out_struct

BOUND = 72.0  # the whole path's |γ_i − γ_32| (module docstring)
BAND = 16  # rows of the diagonal blocks summed on the CUDA cores; the padding of k̃'s and γ's buffers
HALF = C // 2
PIVOTS = (HALF // 2, HALF, HALF + HALF // 2, C - 1)  # γ's rows read by columns (factors, Γ_C)


def check_shapes(*, chunk, K, V, dtype):
    """ValueError naming the argument unless the kernel takes chunk, K, V and the dtype."""
    problem = shape_problem(chunk, K, V, dtype)
    if problem:
        raise ValueError(f"vector_wy='mosaic' needs {problem}")


def paths(gamma):
    """Each (row, chunk, head)'s path as the kernel picks it from gamma [B, Tp, H, K]: 0 whole,
    1 halves, 2 exact (int32 [B, NC, H])."""
    B, Tp, H, K = gamma.shape
    g = gamma.reshape(B, Tp // C, C, H, K)
    spread = lambda x, r: jnp.abs(x - x[:, :, r:r + 1]).max(axis=(2, 4))  # noqa: E731
    halves = jnp.maximum(spread(g[:, :, :HALF], HALF // 2), spread(g[:, :, HALF:], HALF // 2))
    return jnp.select([spread(g, HALF) <= BOUND, halves <= BOUND], [0, 1], 2).astype(jnp.int32)


def _factored(grams, left, right, y_hi, y_lo, mask, interpret):
    """grams + the entries ``mask`` of (Z ⊙ left)(K̃ ⊙ right)ᵀ for Z in (k, q): ``left`` = (k,
    q, ex) [C, K] float32 registers, ``right`` = K̃ ⊙ ey staged in y_hi, y_lo (three bf16
    wgmmas a gram)."""
    k, q, ex = left
    hi, lo = split_bf16(right)
    y_hi[...] = hi
    y_lo[...] = lo
    plgpu.commit_smem()
    sq = (C, C)
    out = []
    for gram, z in zip(grams, (k, q)):
        z_hi, z_lo = split_bf16(z * ex)
        prod = matmul([(z_hi, y_hi.T), (z_hi, y_lo.T), (z_lo, y_hi.T)], sq, None, interpret)
        out.append(gram + jnp.where(mask, prod, 0.0))
    return tuple(out)


def _band(grams, k, q, g, kw_buf, g_buf, interpret):
    """grams + the 16x16 diagonal blocks' entries i >= j in float32 on the CUDA cores (k, q, g
    [C, K] registers; k̃ and γ read d rows up from their padded buffers for each offset d)."""
    i, j = tile_iotas()
    local = lax.rem(plgpu.broadcasted_iota(jnp.int32, g.shape, 0, layout=WGMMA), BAND)
    A, P = grams
    for d in range(BAND):
        rows = pl.ds(BAND - d, C)
        kw_d = read(kw_buf.at[rows], interpret).astype(F32)
        g_d = read(g_buf.at[rows], interpret)
        valid = local >= d
        y = jnp.where(valid, kw_d * jnp.exp(jnp.where(valid, g - g_d, -jnp.inf)), 0.0)
        at = (i - j == d) & (lax.div(i, BAND) == lax.div(j, BAND))
        if d:  # A's diagonal is not in L
            A = A + jnp.where(at, bcast_rows(jnp.sum(k * y, axis=1), (C, C)), 0.0)
        P = P + jnp.where(at, bcast_rows(jnp.sum(q * y, axis=1), (C, C)), 0.0)
    return A, P


def wy_vector_fwd(q, k, kw, v, beta, gamma, *, interpret, t_dtype=F32, passes=3):
    """``wy_vector_triton.wy_vector_fwd``'s outputs (W, U, K̃', Q', P [B, H, Tp, ·] bf16,
    Γ_C [B, H, NC, K] float32 and T [B, H, Tp, C] in ``t_dtype``: float32 for the Triton
    pullback, bf16 for ``wy_vector_pullback_mosaic``; module docstring) of q, k, kw
    [B, Tp, H, K], v [B, Tp, H, V] (bf16), beta [B, Tp, H] and gamma [B, Tp, H, K] (the
    in-chunk cumsum of the per-channel log decays). ``passes``: bf16 wgmmas a merge product
    of the inverse (``inverse_mosaic.unit_lower_inverse``; W and U keep three)."""
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    check_shapes(chunk=C, K=K, V=V, dtype=q.dtype)
    if Tp % C:
        raise ValueError(f"the rows' length Tp must be a multiple of {C}, got {Tp}")
    for name, x in (("k", k), ("kw", kw), ("gamma", gamma)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {q.shape}, got {x.shape}")
    nc = Tp // C
    ins = (q, k, kw, v, beta, gamma)
    out_type = tuple(out_struct(shape, dtype, *ins) for shape, dtype in (
        ((B, H, Tp, K), BF16), ((B, H, Tp, V), BF16), ((B, H, Tp, K), BF16),
        ((B, H, Tp, K), BF16), ((B, H, Tp, C), BF16), ((B, H, nc, K), F32),
        ((B, H, Tp, C), t_dtype)))
    pad = plgpu.SMEM((C, C + PAD), F32)
    # three phases, each its own buffers in one shared region: the grams' right operands; the
    # inverse's; the right operands of W and U, and T staged for its store
    phases = plgpu.RefUnion(  # (the exact path's k̃ and γ with 16 rows in front: their own loads)
        dict(y_hi=smem((C, K), BF16), y_lo=smem((C, K), BF16),
             kw_pad=plgpu.SMEM((BAND + C, K), BF16), g_pad=plgpu.SMEM((BAND + C, K), F32)),
        dict(l_buf=pad, x_buf=pad, hi=smem((C, C), BF16), lo=smem((C, C), BF16)),
        dict(w_hi=smem((C, K), BF16), w_lo=smem((C, K), BF16), u_hi=smem((C, V), BF16),
             u_lo=smem((C, V), BF16), t_out=smem((C, C), t_dtype)))
    scratch = dict(q=smem((C, K), BF16), k=smem((C, K), BF16), v=smem((C, V), BF16),
                   kw=smem((C, K), BF16), g=smem((C, K), F32), piv=plgpu.SMEM((4, K), F32),
                   b=plgpu.SMEM((C,), F32), p_out=smem((C, C), BF16),
                   gc_out=plgpu.SMEM((K,), F32), phases=phases,
                   bar=plgpu.Barrier(num_arrivals=6 + len(PIVOTS)),
                   band_bar=plgpu.Barrier(num_arrivals=2))
    sq = (C, C)

    def body(q_ref, k_ref, kw_ref, v_ref, b_ref, g_ref, W_ref, U_ref, kwt_ref, qd_ref, P_ref,
             gc_ref, T_ref, *, q, k, v, kw, g, piv, b, p_out, gc_out, phases, bar, band_bar):
        grams_bufs, inverse_bufs, out_bufs = phases
        y_hi, y_lo = grams_bufs["y_hi"], grams_bufs["y_lo"]
        bi, h, c = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c")
        rows, own = pl.ds(c * C, C), pl.ds(BAND, C)
        for src, dst in ((q_ref.at[bi, rows, h], q), (k_ref.at[bi, rows, h], k),
                         (kw_ref.at[bi, rows, h], kw), (v_ref.at[bi, rows, h], v),
                         (b_ref.at[bi, h, rows], b), (g_ref.at[bi, rows, h], g)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        for n, r in enumerate(PIVOTS):
            plgpu.copy_gmem_to_smem(g_ref.at[bi, c * C + r, h], piv.at[n], bar)
        plgpu.barrier_wait(bar)
        i, j = tile_iotas()
        tiled = lambda ref: plgpu.load(ref, layout=WGMMA)  # noqa: E731  (a swizzled tile)
        row = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=WGMMA)
        pivot = lambda r: bcast_cols(  # noqa: E731  (γ's row r by columns)
            read(piv.at[PIVOTS.index(r)], interpret, COLS), (C, K))
        quarters = lambda: jnp.where(row < HALF, pivot(HALF // 2),  # noqa: E731  (rows 16, 48)
                                     pivot(HALF + HALF // 2))
        tiles = lambda: (tiled(g),  # noqa: E731  (read where used: fewer live registers)
                         *(tiled(x).astype(F32) for x in (k, q, kw)))

        def whole_path(grams):
            with jax.named_scope("grams_whole"):
                g_t, k_t, q_t, kw_t = tiles()
                x = g_t - pivot(HALF)
                return _factored(grams, (k_t, q_t, jnp.exp(x)), kw_t * jnp.exp(-x), y_hi, y_lo,
                                 i >= j, interpret)

        def across(grams, size, r, t):
            """grams + the entries across the halves of each 2·size-block through its row r
            (t: ``tiles()``)."""
            g_t, k_t, q_t, kw_t = t
            low = lax.rem(row, 2 * size) >= size
            ex = jnp.exp(jnp.where(low, g_t - r, -jnp.inf))
            ey = jnp.exp(jnp.where(low, -jnp.inf, r - g_t))
            mask = ((lax.div(i, 2 * size) == lax.div(j, 2 * size))
                    & (lax.rem(i, 2 * size) >= size) & (lax.rem(j, 2 * size) < size))
            return _factored(grams, (k_t, q_t, ex), kw_t * ey, y_hi, y_lo, mask, interpret)

        def halves_path(grams):
            with jax.named_scope("grams_halves"):
                t = tiles()
                grams = across(grams, HALF, pivot(HALF), t)
                x = t[0] - quarters()
                return _factored(grams, (t[1], t[2], jnp.exp(x)), t[3] * jnp.exp(-x), y_hi,
                                 y_lo, (lax.div(i, HALF) == lax.div(j, HALF)) & (i >= j),
                                 interpret)

        def exact_path(grams):
            with jax.named_scope("grams_exact"):
                t = tiles()
                grams = across(grams, HALF, pivot(HALF), t)
                grams = across(grams, HALF // 2, quarters(), t)
                kw_pad, g_pad = grams_bufs["kw_pad"], grams_bufs["g_pad"]
                plgpu.copy_gmem_to_smem(kw_ref.at[bi, rows, h], kw_pad.at[own], band_bar)
                plgpu.copy_gmem_to_smem(g_ref.at[bi, rows, h], g_pad.at[own], band_bar)
                plgpu.barrier_wait(band_bar)
                return _band(grams, *t[1:3], t[0], kw_pad, g_pad, interpret)

        with jax.named_scope("flag"):
            g_t = tiled(g)
            within = lambda r: jnp.logical_not(  # noqa: E731
                jnp.max(jnp.max(jnp.abs(g_t - r), axis=1)) > BOUND)
            whole, halves = within(pivot(HALF)), within(quarters())
        A, P = lax.cond(whole, whole_path,
                        lambda gr: lax.cond(halves, halves_path, exact_path, gr),
                        (plgpu.layout_cast(jnp.zeros(sq, F32), WGMMA),) * 2)
        with jax.named_scope("inverse"):
            beta_r = plgpu.load(b, layout=ROWS)
            p_out[...] = P.astype(BF16)
            L = jnp.where(i > j, bcast_rows(beta_r, sq) * A, 0.0)
            X = unit_lower_inverse(L, *(inverse_bufs[n] for n in ("hi", "lo", "l_buf", "x_buf")),
                                   interpret, passes)
            t_out = out_bufs["t_out"]
            t_out[...] = X.astype(t_dtype)
        # the scaled inputs (q's and k̃'s buffers take Q' and K̃'), W into k's, U into v's
        with jax.named_scope("outputs"):
            g_last = read(piv.at[PIVOTS.index(C - 1)], interpret, COLS)
            g_t = tiled(g)
            gam = jnp.exp(g_t)
            W = split_product(X, bcast_rows(beta_r, (C, K)) * gam * tiled(k).astype(F32),
                              out_bufs["w_hi"], out_bufs["w_lo"], interpret)
            k[...] = W.astype(BF16)
            q[...] = (tiled(q).astype(F32) * gam).astype(BF16)
            kw[...] = (tiled(kw).astype(F32) * jnp.exp(bcast_cols(g_last, (C, K)) - g_t)
                       ).astype(BF16)
            U = split_product(X, bcast_rows(beta_r, (C, V)) * tiled(v).astype(F32),
                              out_bufs["u_hi"], out_bufs["u_lo"], interpret)
            v[...] = U.astype(BF16)
            write(gc_out, jnp.exp(g_last), interpret, COLS)
        plgpu.commit_smem()
        for src, dst in ((k, W_ref.at[bi, h, rows]), (v, U_ref.at[bi, h, rows]),
                         (kw, kwt_ref.at[bi, h, rows]), (q, qd_ref.at[bi, h, rows]),
                         (p_out, P_ref.at[bi, h, rows]), (gc_out, gc_ref.at[bi, h, c]),
                         (t_out, T_ref.at[bi, h, rows])):
            plgpu.copy_smem_to_gmem(src, dst, commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    vec = jnp.moveaxis(beta, 2, 1).astype(F32)  # [B, Tp, H] -> [B, H, Tp]
    return kernel(body, name="wy_vector_mosaic", out_type=out_type, scratch=scratch,
                  grid=(B, H, nc), interpret=interpret, grid_names=("b", "h", "c"))(
        q, k, kw, v, vec, gamma.astype(F32))

