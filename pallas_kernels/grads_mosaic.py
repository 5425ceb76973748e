"""The split backward's per-chunk cotangents and the WY pullback in one Mosaic GPU kernel
(wgmma, TMA; Hopper), no decay or a scalar one: rung 2's first kernel (benchmarks/NOTES.md).

It replaces ``state_bwd_triton.chunk_grads`` and ``wy_triton.wy_bwd`` (which pass dW, dK̃', dQ',
dP and dΓ_C through HBM in float32) for chunks of 64 with K, V in {64, 128}. One CTA a
(batch row, head, chunk) reads the chunk's q, k, k̃, v, dO, its T = (I + L)^-1
(``wy_fwd``'s, in bf16), R and dR (the state passes'), the chunk-start state S and the cotangent
dS_C of the chunk-end state (both transposed, as ``state_mosaic`` stores them), β and the
in-chunk cumsum G of the log decays (0 without a decay), and forms, with Γ = exp G, Γ_C = exp
G_{C−1}, D_ij = exp(G_i − G_j) (i >= j), A = K K̃ᵀ ⊙ D, L = strict_tril(Diag(β) A):

    X = V − Diag(Γ) K S      dX = Diag(β) Tᵀ dR = dV          dT = dR (Diag(β) X)ᵀ
    dL = strict_tril(−Tᵀ dT Tᵀ)     G_K = Diag(β) dL ⊙ D      dP = scale tril(dO Rᵀ)
    P = tril(Q K̃ᵀ) ⊙ D             G_Q = dP ⊙ D
    dQ = scale Diag(Γ) dO Sᵀ + G_Q K̃        dK = −Diag(Γ) dX Sᵀ + G_K K̃
    dK̃ = Diag(Γ_C/Γ) R dS_Cᵀ + G_Kᵀ K + G_Qᵀ Q
    dβ = rowsum(Tᵀ dR ⊙ X) + rowsum(dL ⊙ A)
    dG_i = rowsum(E)_i − colsum(E)_i + scale Γ_i ⟨dO_i, (Q S)_i⟩ − Γ_i ⟨dX_i, (K S)_i⟩ − w_i
           + δ_{i,C−1} (Σ_j w_j + Γ_C ⟨dS_C, S⟩),   w_i = (Γ_C/Γ_i) ⟨k̃_i, dS_C r_i⟩,
    E = (dL ⊙ L + dP ⊙ P) off the diagonal

(``chunk_pullback``'s algebra with the decayed inverse T in place of T0: L carries the decay,
as ``wy_bwd``'s pullback does). The caller turns dG into dg (a reverse cumsum in the chunk).
The work is two chains, in one warpgroup or in one each (``warpgroups``): chain 0 forms X, dV,
dT, dL, G_K, dK and E_I = dL ⊙ L's row and column sums (colsum as the diagonal of ones @ E_I),
chain 1 dP, G_Q, dQ, E_O = dP ⊙ P's row sums and its column sums as the row sums of the
transposed products (R dOᵀ ⊙ K̃ Qᵀ ⊙ Dᵀ), then, once G_K is written, dK̃ and w.
All dots take bf16 operands with float32 accumulation (the parallel kernels' ``bf16`` dots);
the results are stored in the inputs' dtypes, dβ and dG in float32.

As in ``state_mosaic``, wgmma has no CPU lowering in jax 0.11.2: in interpret mode (CPU) the
dots run as ``jnp.dot`` of the same bf16 operands, and the CPU tests check everything else; the
wgmma path is checked on the device by benchmarks/bench_delta.py.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.state_mosaic import (BF16, C, COLS, F32, ROWS, WGMMA, bcast_cols, bcast_rows,
                                         decay_matrix, kernel, matmul, products, smem,
                                         tile_iotas)
from pallas_kernels.triton_common import out_struct


def shape_problem(chunk, K, V, dtype) -> str | None:
    """Why a bf16 Mosaic kernel on chunks of 64 with K, V in {64, 128} (this one, and
    ``wy_vector_mosaic``) cannot take chunk, K, V and the inputs' dtype, or None."""
    if jnp.dtype(dtype) != BF16:
        return f"bfloat16 inputs, got {dtype}"
    if chunk != C:
        return f"chunk_size {C}, got {chunk}"
    for name, n in (("K", K), ("V", V)):
        if n not in (64, 128):
            return f"the (padded) head dim {name} in (64, 128), got {n}"
    return None


def fits(*, chunk, K, V, dtype) -> bool:
    """Whether the kernel takes chunk, K, V and the inputs' dtype (``check_shapes`` says why
    not)."""
    return shape_problem(chunk, K, V, dtype) is None


def check_shapes(*, chunk, K, V, dtype):
    """ValueError naming the argument unless the kernel takes chunk, K, V and the inputs'
    dtype."""
    problem = shape_problem(chunk, K, V, dtype)
    if problem:
        raise ValueError(f"the fused Mosaic chunk gradients need {problem}")


def chunk_grads_fused(q, k, kw, v, do, T, beta, gamma, R, dR, states, dstates, *, scale,
                      interpret, warpgroups=1):
    """dq, dk, dk̃ [B, Tp, H, K], dv [B, Tp, H, V] (bf16), dβ and dG [B, Tp, H] float32
    (module docstring). q, k, kw [B, Tp, H, K], v, do [B, Tp, H, V] bf16; T
    [B, H, Tp, C] (any float dtype: cast to bf16); beta [B, Tp, H]; gamma [B, Tp, H] (the
    in-chunk cumsum of the log decays; zeros without a decay); R, dR [B, H, Tp, V] bf16; states,
    dstates [B, H, NC, V, K] bf16 (transposed: ``state_mosaic``'s chunk-start states and
    chunk-end cotangents). ``warpgroups``: 1, every step in one warpgroup, or 2, the two
    chains below in a warpgroup each (each its own 255 registers; the second waits for G_K)."""
    B, Tp, H, K = q.shape
    V, nc = v.shape[-1], Tp // C
    check_shapes(chunk=Tp // states.shape[2], K=K, V=V, dtype=q.dtype)
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups!r}")
    vec = lambda x: jnp.moveaxis(x, 2, 1).astype(F32)  # noqa: E731  [B, Tp, H] -> [B, H, Tp]
    args = [q, k, kw, v, do, T.astype(BF16), vec(beta), vec(gamma), R, dR, states, dstates]
    ins = (q, k, kw, v, do, T, beta, gamma, R, dR, states, dstates)
    out_type = tuple(out_struct(shape, dtype, *ins) for shape, dtype in (
        ((B, Tp, H, K), BF16), ((B, Tp, H, K), BF16), ((B, Tp, H, K), BF16),
        ((B, Tp, H, V), BF16), ((B, H, Tp), F32), ((B, H, Tp), F32)))
    tile = lambda n: smem((C, n), BF16)  # noqa: E731
    scratch = dict(q=tile(K), k=tile(K), kw=tile(K), v=tile(V), do=tile(V), r=tile(V),
                   dr=tile(V), s=smem((V, K), BF16), ds=smem((V, K), BF16), t=tile(C),
                   dt=tile(C), gk=tile(C), gq=tile(C), b=plgpu.SMEM((C,), F32),
                   g_r=plgpu.SMEM((C,), F32), g_c=plgpu.SMEM((C,), F32), tot=plgpu.SMEM((C,), F32),
                   db_out=plgpu.SMEM((C,), F32), dg_out=plgpu.SMEM((C,), F32),
                   bar=plgpu.Barrier(num_arrivals=13))
    if K != V:  # the outputs' own buffers (else dQ, dK, dK̃ reuse dO's, v's and R's)
        scratch.update(dq_o=tile(K), dk_o=tile(K), dkw_o=tile(K))
    if warpgroups == 2:  # G_K written; chain 1's dβ and dG parts written; both done; and the
        # second warpgroup's own β and G (each shared buffer loaded to registers once: a second
        # load of one, even in the same layout, made Mosaic's layout inference fail)
        scratch.update(gk_ready=plgpu.Barrier(), part_ready=plgpu.Barrier(),
                       done=plgpu.Barrier(num_arrivals=2), b1=plgpu.SMEM((C,), F32),
                       g_r1=plgpu.SMEM((C,), F32), g_c1=plgpu.SMEM((C,), F32),
                       sd_out=plgpu.SMEM((C,), F32))
        scratch["bar"] = plgpu.Barrier(num_arrivals=16)
    sv, sk, sq = (C, V), (C, K), (C, C)

    def body(q_ref, k_ref, kw_ref, v_ref, do_ref, t_ref, b_ref, g_ref, r_ref, dr_ref, s_ref,
             ds_ref, dq_ref, dk_ref, dkw_ref, dv_ref, db_ref, dg_ref, *, q, k, kw, v, do,
             r, dr, s, ds, t, dt, gk, gq, b, g_r, g_c, tot, db_out, dg_out, bar, dq_o=None,
             dk_o=None, dkw_o=None, gk_ready=None, part_ready=None, done=None, b1=None,
             g_r1=None, g_c1=None, sd_out=None):
        dq_o, dk_o, dkw_o = (do, v, r) if dq_o is None else (dq_o, dk_o, dkw_o)
        bi, h, c = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c")
        rows = pl.ds(c * C, C)

        def gates(b, g_r, g_c):
            """(i, j iotas, G by rows, G by columns, β by rows, Γ, G_{C−1}, Γ_C/Γ, D) from the
            buffers b, g_r, g_c."""
            i, j = tile_iotas()
            g_row, g_col = plgpu.load(g_r, layout=ROWS), plgpu.load(g_c, layout=COLS)
            last_col = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=COLS) == C - 1
            g_last = jnp.where(last_col, g_col, 0.0).sum()  # G_{C−1}
            D = decay_matrix(i, j, g_row, g_col)
            return (i, j, g_row, g_col, plgpu.load(b, layout=ROWS), jnp.exp(g_row), g_last,
                    jnp.exp(g_last - g_row), D)

        def chain_0(z):
            """X, dV, dT; the inverse's dL, G_K; dK; E_I = dL ⊙ L's row and column sums: this
            chain's (dβ, dG) parts."""
            i, j, _, _, beta_row, gam, g_last, _, D = z
            tdr, ks = products([(t.T, dr, sv), (k, s.T, sv)], interpret)  # Tᵀ dR, K S
            dgam = -gam * beta_row * jnp.sum(tdr * ks, axis=1)  # −Γ ⟨dX, K S⟩
            x = plgpu.load(v, layout=WGMMA).astype(F32) - bcast_rows(gam, sv) * ks
            dbeta = jnp.sum(tdr * x, axis=1)
            v[...] = (bcast_rows(beta_row, sv) * x).astype(BF16)  # v's buffer now holds Diag(β) X
            dx_lo = (bcast_rows(beta_row, sv) * tdr).astype(BF16)
            plgpu.commit_smem()
            dtm = matmul([(dr, v.T)], sq, None, interpret)  # dT = dR (Diag(β) X)ᵀ
            dr[...] = dx_lo  # dR's buffer now holds dV = dX (read again for dK)
            dt[...] = dtm.astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dr, dv_ref.at[bi, rows, h], commit_group=False)
            m, a = products([(t.T, dt, sq), (k, kw.T, sq)], interpret)  # Tᵀ dT, K K̃ᵀ
            a = a * D  # A = K K̃ᵀ ⊙ D
            dl = -jnp.where(i > j, matmul([(m.astype(BF16), t.T)], sq, None, interpret), 0.0)
            plgpu.commit_smem()  # (every thread is done reading T and dT: E_I goes there below)
            dbeta = dbeta + jnp.sum(dl * a, axis=1)
            e = jnp.where(i != j, bcast_rows(beta_row, sq) * dl * a, 0.0)  # dL ⊙ L = β dL ⊙ A
            gk[...] = (bcast_rows(beta_row, sq) * dl * D).astype(BF16)
            plgpu.commit_smem()
            if gk_ready is not None:
                plgpu.barrier_arrive(gk_ready)
            dk_s = -bcast_rows(gam, sk) * matmul([(dr, s)], sk, None, interpret)  # −Diag(Γ) dX Sᵀ
            dk_o[...] = matmul([(gk, kw)], sk, dk_s, interpret).astype(BF16)  # (K = V: v's)
            # colsum(E_I) as the diagonal of ones @ E_I, split into two bf16 parts (~2^-16)
            e_hi = e.astype(BF16)
            dt[...] = e_hi
            t[...] = (e - e_hi.astype(F32)).astype(BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dk_o, dk_ref.at[bi, rows, h], commit_group=False)
            ones = plgpu.layout_cast(jnp.ones(sq, BF16), WGMMA)
            cols = jnp.sum(jnp.where(i == j, matmul([(ones, dt), (ones, t)], sq, None, interpret),
                                     0.0), axis=1)
            sds = 0.0  # ⟨S, dS_C⟩ by rows of the transposed tiles (for the last row's dG)
            for half in range(V // C):
                s_f, ds_f = (plgpu.load(x.at[pl.ds(half * C, C)], layout=WGMMA).astype(F32)
                             for x in (s, ds))
                sds = sds + jnp.sum(s_f * ds_f, axis=1)
            return dbeta, dgam + jnp.sum(e, axis=1) - cols, jnp.exp(g_last) * sds

        def chain_1(z):
            """dP, G_Q, dQ; E_O = dP ⊙ P's row sums and, as row sums of the transposed products,
            its column sums; then (after G_K) dK̃ and w: this chain's (dG part, w)."""
            i, j, g_row, g_col, _, gam, _, tail, D = z
            dp, p = products([(do, r.T, sq), (q, kw.T, sq)], interpret)  # dO Rᵀ, Q K̃ᵀ
            dp = scale * jnp.where(i >= j, dp, 0.0)
            dgam = jnp.sum(jnp.where(i > j, dp * p, 0.0) * D, axis=1)  # rowsum(E_O)
            gq[...] = (dp * D).astype(BF16)
            plgpu.commit_smem()
            rdo, kwq = products([(r, do.T, sq), (kw, q.T, sq)], interpret)  # R dOᵀ, K̃ Qᵀ
            d_t = jnp.exp(jnp.where(j > i, bcast_cols(g_col, sq) - bcast_rows(g_row, sq), -jnp.inf))
            dgam = dgam - scale * jnp.sum(rdo * kwq * d_t, axis=1)  # colsum(E_O) = rowsum(E_Oᵀ)
            dos = matmul([(do, s)], sk, None, interpret)  # dO Sᵀ
            q_f = plgpu.load(q, layout=WGMMA).astype(F32)
            dgam = dgam + scale * gam * jnp.sum(q_f * dos, axis=1)  # ⟨dO, Q S⟩ = ⟨Q, dO Sᵀ⟩
            dq_o[...] = matmul([(gq, kw)], sk, scale * bcast_rows(gam, sk) * dos,
                               interpret).astype(BF16)  # (K = V: dO's buffer, done with)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_o, dq_ref.at[bi, rows, h], commit_group=False)
            if gk_ready is not None:
                plgpu.barrier_wait(gk_ready)
            rds = matmul([(r, ds)], sk, None, interpret)  # R dS_Cᵀ
            w = tail * jnp.sum(rds * plgpu.load(kw, layout=WGMMA).astype(F32), axis=1)
            dkw_o[...] = matmul([(gk.T, k), (gq.T, q)], sk, bcast_rows(tail, sk) * rds,
                                interpret).astype(BF16)  # (K = V: R's buffer, done with)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dkw_o, dkw_ref.at[bi, rows, h], commit_group=False)
            return dgam, w

        def finish(dbeta, dgam, w, sd):
            """dG's terms of the last row (Σ_j w_j + Γ_C ⟨dS_C, S⟩: w and sd by rows summed)
            and w; dβ and dG out."""
            tot[...] = w + sd
            plgpu.commit_smem()
            total = plgpu.load(tot, layout=COLS).sum()
            at_last = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=ROWS) == C - 1
            db_out[...] = dbeta
            dg_out[...] = dgam - w + jnp.where(at_last, total, 0.0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(db_out, db_ref.at[bi, h, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(dg_out, dg_ref.at[bi, h, rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        def load_all():
            extra = ((b_ref.at[bi, h, rows], b1), (g_ref.at[bi, h, rows], g_r1),
                     (g_ref.at[bi, h, rows], g_c1)) if b1 is not None else ()
            for src, dst in extra + ((q_ref.at[bi, rows, h], q), (k_ref.at[bi, rows, h], k),
                             (kw_ref.at[bi, rows, h], kw), (v_ref.at[bi, rows, h], v),
                             (do_ref.at[bi, rows, h], do), (r_ref.at[bi, h, rows], r),
                             (dr_ref.at[bi, h, rows], dr), (s_ref.at[bi, h, c], s),
                             (ds_ref.at[bi, h, c], ds), (t_ref.at[bi, h, rows], t),
                             (b_ref.at[bi, h, rows], b), (g_ref.at[bi, h, rows], g_r),
                             (g_ref.at[bi, h, rows], g_c)):  # G twice: one buffer, one layout
                plgpu.copy_gmem_to_smem(src, dst, bar)

        if warpgroups == 1:
            load_all()
            plgpu.barrier_wait(bar)
            z = gates(b, g_r, g_c)
            dbeta, dgam0, sd = chain_0(z)
            dgam1, w = chain_1(z)
            finish(dbeta, dgam0 + dgam1, w, sd)
            return

        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _():
            load_all()
            plgpu.barrier_wait(bar)
            dbeta, dgam, sd = chain_0(gates(b, g_r, g_c))
            db_out[...] = dbeta
            dg_out[...] = dgam
            sd_out[...] = sd
            plgpu.commit_smem()
            plgpu.barrier_arrive(part_ready)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _():
            plgpu.barrier_wait(bar)
            z = gates(b1, g_r1, g_c1)
            dgam, w = chain_1(z)
            plgpu.barrier_wait(part_ready)
            finish(plgpu.load(db_out, layout=ROWS), plgpu.load(dg_out, layout=ROWS) + dgam, w,
                   plgpu.load(sd_out, layout=ROWS))

        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    dq, dk, dkw, dv, db, dg = kernel(
        body, name="chunk_grads_mosaic", out_type=out_type, scratch=scratch, grid=(B, H, nc),
        interpret=interpret, grid_names=("b", "h", "c"), warpgroups=warpgroups)(*args)
    back = functools.partial(jnp.moveaxis, source=1, destination=2)  # [B, H, Tp] -> [B, Tp, H]
    return dq, dk, dkw, dv, back(db), back(dg)
