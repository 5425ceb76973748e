"""The Mosaic serial state passes fed by the inverse T and the raw inputs instead of the WY
tensors (jax-linear-attention's / FlashQLA's fused forward): no W, U, K̃' or Q' in HBM.

With a scalar (or no) decay every WY tensor is an input tile scaled by a per-row vector, so
each pass applies T and the scalings to its own products (chunk rows i, j; β the write
strengths, Γ = exp γ the in-chunk cumulative decay, Γ_C/Γ = exp σ, transposed carry Sᵀ
[BV, K] float32 in registers, one CTA per (batch row, head, 64-wide V tile) as in
``state_mosaic``):

    forward (chunks in order)
        Yᵀ  = Vᵀ Diag(β) − (Sᵀ Kᵀ) Diag(βΓ)           (Diag(β)(V − Diag(Γ) K S))ᵀ
        Rᵀ  = Yᵀ Tᵀ                                    (= (U − W S)ᵀ of SPEC 2.1)
        Oᵀ  = scale ((Sᵀ Qᵀ) Diag(Γ) + Rᵀ Pᵀ)          (Q' = Diag(Γ) Q)
        Sᵀ ← Γ_C Sᵀ + (Rᵀ Diag(Γ_C/Γ)) K̃               (K̃' = Diag(Γ_C/Γ) K̃)
    backward (chunks reversed)
        dRᵀ = Aᵀ + (dSᵀ K̃ᵀ) Diag(Γ_C/Γ)               (A = scale Pᵀ dO, ``dout_products``)
        dSᵀ ← Γ_C dSᵀ + ((scale dO)ᵀ Diag(Γ)) Q − ((dRᵀ T) Diag(βΓ)) K

The forward chain is three dependent products a chunk (the WY form's two, after
``wy_fwd`` wrote W and U); Sᵀ Qᵀ joins the first as one wgmma group. Operands are bf16
(Y, R Diag(Γ_C/Γ), dR T Diag(βΓ) and scale dO Diag(Γ) rounded once, after their scaling),
accumulators float32, as in ``state_mosaic``. The stored results are those of
``state_mosaic``'s passes (chunk states and R, then dR and dS_C, transposed, bf16), so
``grads_mosaic`` reads them unchanged. The per-row vectors come as one float32 array
[B, H, 4, Tp] (from either ``wy_inverse``: ``inverse_mosaic``'s or ``wy_triton``'s), each
loaded once a chunk into its own buffer (Mosaic's layout inference fails on one buffer loaded
twice, benchmarks/NOTES.md session 14). Given no P (``Options.p_in_serial``), the passes form
P = (Q K̃ᵀ) ⊙ D, D_ij = exp(γ_i − γ_j) (i >= j), from the q and k̃ tiles they load anyway and
γ, a fifth row (``inverse_mosaic.wy_inverse_rows``), and the backward forms Aᵀ = scale dOᵀ P
itself (no P or A through HBM: DeltaNet / GDN f+b -5 % / -7 %, RESULTS run 158). Dense rows or
chunk-aligned documents (the flags of ``state_mosaic``); no sequence pieces.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.state_mosaic import (BF16, BV, C, COLS, F32, FLAGS, ROWS, WGMMA,
                                         _doc_state_in, _doc_state_out, _doc_states, _flags,
                                         _loop, _start, backward_call, check_shapes, columns,
                                         decay_matrix, kernel, matmul, products,
                                         restart_cotangent, restart_state, smem,
                                         store_cotangents, tile_iotas)
from pallas_kernels.triton_common import out_struct

BETA, BETA_GAMMA, GAMMA, TAIL, LOG_GAMMA = range(5)  # rows of the vectors (``wy_inverse``'s;
#   γ, the fifth, from ``inverse_mosaic.wy_inverse_rows`` only: for P formed in the passes)


def _issue(c, slot, bar, position, pairs, vec_ref, vec_bufs):
    """TMA copies of chunk ``c``: (GMEM ref, SMEM buffer, columns: None for a [B, H, Tp, ·]
    tensor, else the V columns of a [B, Tp, H, ·] one or ``"all"``) and, for each (row, buffer)
    of ``vec_bufs``, that row of the vectors into its own buffer (a row read by rows and by
    columns goes to two)."""
    b, h, v0 = position
    rows = pl.ds(c * C, C)
    for src, dst, cols in pairs:
        if cols is None:
            tile = src.at[b, h, rows]
        elif cols == "all":
            tile = src.at[b, rows, h]
        else:
            tile = src.at[b, rows, h, pl.ds(v0, BV)]
        plgpu.copy_gmem_to_smem(tile, dst.at[slot], bar)
    for row, buf in vec_bufs:
        plgpu.copy_gmem_to_smem(vec_ref.at[b, h, row, rows], buf.at[slot], bar)


def _stage_p(qk, g_r, g_c, slot, p):
    """P = (Q K̃ᵀ) ⊙ D, D_ij = exp(γ_i − γ_j) (i >= j), into the bf16 buffer ``p`` from the
    product ``qk`` and the slot's γ by rows (``g_r``) and by columns (``g_c``)."""
    i, j = tile_iotas()
    D = decay_matrix(i, j, plgpu.load(g_r.at[slot], layout=ROWS),
                     plgpu.load(g_c.at[slot], layout=COLS))
    p[...] = (qk * D).astype(BF16)
    plgpu.commit_smem()


def state_fwd(T, k, kw, v, q, P, vecs, gc, initial_state, doc, first, last, *, scale, out_dtype,
              num_docs, interpret, store=True, warpgroups=1):
    """Forward pass from T, P [B, H, Tp, C] (bf16, ``wy_inverse``), the inputs k, k̃, q
    [B, Tp, H, K] and v [B, Tp, H, V] (bf16), ``vecs`` (rows β, βΓ, Γ, Γ_C/Γ [B, H, 4, Tp]
    float32) and Γ_C [B, H, NC, K]:
    a list, if ``store`` the chunk-start states [B, H, NC, V, K] (transposed) and R [B, H, Tp,
    V], both bf16 (the backward's; a forward alone needs neither), then the final states [N,
    H, K, V] float32 and o = scale (Q' S + P R) [B, Tp, H, V] in ``out_dtype`` (module
    docstring). P None: formed here, P = (Q K̃ᵀ) ⊙ D with D_ij = exp(γ_i − γ_j) (i >= j) from
    the fifth row of ``vecs``, γ (``inverse_mosaic.wy_inverse_rows``), in the first product
    group of the step, so no P goes through HBM. ``initial_state``: None or [N, H, K, V];
    ``num_docs``: N, or None for one document per batch row. ``warpgroups`` 2 (P None only):
    jax-linear-attention's split, the chain (Sᵀ Kᵀ, R, the state update, the stores of S and R)
    in warpgroup 0, the output (Sᵀ Qᵀ, P, Oᵀ, o's store) in warpgroup 1: warpgroup 0 publishes
    each chunk's bf16 S at the step's start and R once formed (``s_ready``, ``r_ready``), so
    warpgroup 1's Sᵀ Qᵀ and P run beside the chain's Sᵀ Kᵀ and R, and its Rᵀ Pᵀ beside the
    state update; it releases the chunk's slot and S, R once read (``released``), which
    warpgroup 0 waits for before refilling that slot (the next step's start)."""
    if warpgroups not in (1, 2) or (warpgroups == 2 and P is not None):
        raise ValueError(f"warpgroups must be 1, or 2 with P None (formed here), got "
                         f"{warpgroups!r} with P {'None' if P is None else 'given'}")
    B, H, Tp, _ = T.shape
    K, V, nc = k.shape[-1], v.shape[-1], Tp // C
    check_shapes(chunk=Tp // gc.shape[2], K=K, V=V)
    N, has_init, form_p = B if num_docs is None else num_docs, initial_state is not None, P is None
    ins = (T, k, kw, v, q, P, vecs, gc, initial_state)
    out_type = [out_struct((N, H, V, K), F32, *ins), out_struct((B, Tp, H, V), out_dtype, *ins)]
    vec = plgpu.SMEM((2, C), F32)
    scratch = dict(t=smem((2, C, C), BF16), p=smem((C, C) if form_p else (2, C, C), BF16),
                   k=smem((2, C, K), BF16), kw=smem((2, C, K), BF16), q=smem((2, C, K), BF16),
                   v=smem((2, C, BV), BF16), vb=vec, vbg=vec, vg=vec, vt=vec,
                   g=plgpu.SMEM((2, K), F32), fl=plgpu.SMEM((2, FLAGS), jnp.int32),
                   doc_buf=plgpu.SMEM((BV, K), F32), doc_bar=plgpu.Barrier(),
                   in_bar=plgpu.Barrier(num_arrivals=12 + form_p, num_barriers=2),
                   o_out=smem((C, BV), out_dtype))
    if form_p:
        scratch.update(g_r=vec, g_c=vec)
    if store:
        out_type[:0] = [out_struct((B, H, nc, V, K), BF16, *ins),
                        out_struct((B, H, Tp, V), BF16, *ins)]
    if store or warpgroups == 2:  # the stores' staging, with two warpgroups the publications
        scratch.update(s_out=smem((BV, K), BF16), r_out=smem((C, BV), BF16))
    if warpgroups == 2:
        scratch.update(s_ready=plgpu.Barrier(), r_ready=plgpu.Barrier(),
                       released=plgpu.Barrier())
    args = [T] + ([] if form_p else [P]) + [k, kw, q, v, vecs, gc, _flags(doc, first, last)]
    args += [_doc_states(initial_state)] if has_init else []

    def body(*refs, t, p, k, kw, q, v, vb, vbg, vg, vt, g, fl, doc_buf, doc_bar, in_bar, o_out,
             s_out=None, r_out=None, g_r=None, g_c=None, s_ready=None, r_ready=None,
             released=None):
        refs = list(refs)
        T_ref = refs.pop(0)
        P_ref = None if form_p else refs.pop(0)
        k_ref, kw_ref, q_ref, v_ref, vec_ref, gc_ref, f_ref = (refs.pop(0) for _ in range(7))
        init_ref = refs.pop(0) if has_init else None
        states_ref, R_ref = (refs.pop(0), refs.pop(0)) if store else (None, None)
        final_ref, o_ref = refs
        b, h, v0 = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v") * BV

        def issue(c, slot):
            bar = in_bar.at[slot]
            tiles = [(T_ref, t, None)] + ([] if form_p else [(P_ref, p, None)])
            rows = [(BETA, vb), (BETA_GAMMA, vbg), (GAMMA, vg), (TAIL, vt)]
            rows += [(LOG_GAMMA, g_r), (LOG_GAMMA, g_c)] if form_p else []
            _issue(c, slot, bar, (b, h, v0), tiles + [
                (k_ref, k, "all"), (kw_ref, kw, "all"), (q_ref, q, "all"), (v_ref, v, "v")],
                vec_ref, rows)
            plgpu.copy_gmem_to_smem(gc_ref.at[b, h, c], g.at[slot], bar)
            plgpu.copy_gmem_to_smem(f_ref.at[b, c], fl.at[slot], bar)

        def step(c, slot, S):
            d, is_first, is_last = fl[slot, 0], fl[slot, 1], fl[slot, 2]
            rows = pl.ds(c * C, C)
            S = restart_state(S, init_ref, d, h, v0, (doc_buf, doc_bar), is_first)
            s_lo = S.astype(BF16)
            ks_t, qs_t, *qk = products(
                [(s_lo, k.at[slot].T, (BV, C)), (s_lo, q.at[slot].T, (BV, C))]
                + ([(q.at[slot], kw.at[slot].T, (C, C))] if form_p else []),
                interpret)  # Sᵀ Kᵀ, Sᵀ Qᵀ (and Q K̃ᵀ)
            if form_p:  # (the last step's product read P's buffer: waited)
                _stage_p(qk[0], g_r, g_c, slot, p)
            v_t = plgpu.load(v.at[slot].T, layout=WGMMA).astype(F32)
            y_lo = (v_t * columns(vb, slot) - ks_t * columns(vbg, slot)).astype(BF16)
            r_t = matmul([(y_lo, t.at[slot].T)], (BV, C), None, interpret)  # Rᵀ = Yᵀ Tᵀ
            r_lo = r_t.astype(BF16)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's stores were read
            if store:
                s_out[...] = s_lo
                r_out.T[...] = r_lo
            o_t = matmul([(r_lo, p.T if form_p else p.at[slot].T)], (BV, C),
                         qs_t * columns(vg, slot), interpret)  # Oᵀ / scale = (Sᵀ Qᵀ) Diag(Γ) + Rᵀ Pᵀ
            o_out.T[...] = (scale * o_t).astype(o_out.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_out, o_ref.at[b, rows, h, pl.ds(v0, BV)], commit_group=False)
            if store:  # (s_out and r_out fenced with o_out above)
                plgpu.copy_smem_to_gmem(s_out, states_ref.at[b, h, c, pl.ds(v0, BV)],
                                        commit_group=False)
                plgpu.copy_smem_to_gmem(r_out, R_ref.at[b, h, rows, pl.ds(v0, BV)],
                                        commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            decay = columns(g, slot)
            rt_lo = (r_t * columns(vt, slot)).astype(BF16)
            S = matmul([(rt_lo, kw.at[slot])], (BV, K), S * decay, interpret)  # Γ_C Sᵀ + ... K̃
            _doc_state_out(S, final_ref, d, h, v0, doc_buf, is_last)
            return S

        def chain_step(c, slot, S):  # warpgroup 0 of two
            d, is_first, is_last = fl[slot, 0], fl[slot, 1], fl[slot, 2]
            rows = pl.ds(c * C, C)
            S = restart_state(S, init_ref, d, h, v0, (doc_buf, doc_bar), is_first)
            s_lo = S.astype(BF16)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's stores were read
            s_out[...] = s_lo
            plgpu.commit_smem()
            plgpu.barrier_arrive(s_ready)
            ks_t = matmul([(s_lo, k.at[slot].T)], (BV, C), None, interpret)  # Sᵀ Kᵀ
            v_t = plgpu.load(v.at[slot].T, layout=WGMMA).astype(F32)
            y_lo = (v_t * columns(vb, slot) - ks_t * columns(vbg, slot)).astype(BF16)
            r_t = matmul([(y_lo, t.at[slot].T)], (BV, C), None, interpret)  # Rᵀ = Yᵀ Tᵀ
            r_out.T[...] = r_t.astype(BF16)
            plgpu.commit_smem()
            plgpu.barrier_arrive(r_ready)
            if store:
                plgpu.copy_smem_to_gmem(s_out, states_ref.at[b, h, c, pl.ds(v0, BV)],
                                        commit_group=False)
                plgpu.copy_smem_to_gmem(r_out, R_ref.at[b, h, rows, pl.ds(v0, BV)],
                                        commit_group=False)
                plgpu.commit_smem_to_gmem_group()
            rt_lo = (r_t * columns(vt, slot)).astype(BF16)
            S = matmul([(rt_lo, kw.at[slot])], (BV, K), S * columns(g, slot), interpret)
            _doc_state_out(S, final_ref, d, h, v0, doc_buf, is_last)
            return S

        def output(n, carry):  # warpgroup 1 of two: chunk n's Oᵀ from the published S, R
            slot, rows = lax.rem(n, 2), pl.ds(n * C, C)
            plgpu.barrier_wait(in_bar.at[slot])
            plgpu.barrier_wait(s_ready)
            qs_t, qk = products([(s_out, q.at[slot].T, (BV, C)),
                                 (q.at[slot], kw.at[slot].T, (C, C))], interpret)
            _stage_p(qk, g_r, g_c, slot, p)  # (the last chunk's product read p: waited)
            plgpu.barrier_wait(r_ready)
            o_t = matmul([(r_out.T, p.T)], (BV, C), qs_t * columns(vg, slot), interpret)
            plgpu.barrier_arrive(released)  # the slot, S and R read: the chain may go on
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's o was read
            o_out.T[...] = (scale * o_t).astype(o_out.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_out, o_ref.at[b, rows, h, pl.ds(v0, BV)])
            return carry

        if warpgroups == 1:
            _start(doc_buf)
            _loop(nc, False, issue, in_bar, step, K)
            return

        @pl.when(lax.axis_index("wg") == 0)
        def _chain():
            _start(doc_buf)
            _loop(nc, False, issue, in_bar, chain_step, K, released)
            plgpu.barrier_wait(released)  # the last chunk's: every phase observed

        @pl.when(lax.axis_index("wg") == 1)
        def _outputs():
            lax.fori_loop(0, nc, output, None)
            plgpu.wait_smem_to_gmem(0)

    outs = list(kernel(body, name="state_fwd_wy_mosaic", out_type=tuple(out_type),
                        scratch=scratch, grid=(B, H, V // BV), interpret=interpret,
                        warpgroups=warpgroups)(*args))
    outs[2 * store] = _doc_states(outs[2 * store])
    return outs


def state_bwd(T, k, kw, q, vecs, gc, A, do, dfinal, doc, first, last, *, scale, interpret):
    """Backward pass: dU = dR [B, H, Tp, V] and the chunk-end cotangents dS_C [B, H, NC, V, K]
    (transposed), both bf16; dS_0 [N, H, K, V] float32 (module docstring). T, k, k̃, q, vecs,
    Γ_C as for ``state_fwd``; A = scale Pᵀ dO [B, H, Tp, V] bf16, or None: Aᵀ = scale dOᵀ P
    formed here from P = (Q K̃ᵀ) ⊙ D (D from γ, ``vecs``' fifth row, as ``state_fwd`` forms
    it) and the bf16 dO, in float32 (no A through HBM, no ``dout_products`` kernel); dO [B, Tp,
    H, V] 16-bit; dfinal [N, H, K, V]."""
    B, H, Tp, _ = T.shape
    K, V, nc, N = k.shape[-1], do.shape[-1], Tp // C, dfinal.shape[0]
    check_shapes(chunk=Tp // gc.shape[2], K=K, V=V)
    form_a = A is None
    ins = (T, k, kw, q, vecs, gc, A, do, dfinal)
    out_type = (out_struct((B, H, Tp, V), BF16, *ins), out_struct((B, H, nc, V, K), BF16, *ins),
                out_struct((N, H, V, K), F32, *ins))
    vec = plgpu.SMEM((2, C), F32)
    scratch = dict(t=smem((2, C, C), BF16), k=smem((2, C, K), BF16), kw=smem((2, C, K), BF16),
                   q=smem((2, C, K), BF16), dout=smem((2, C, BV), do.dtype), vbg=vec, vg=vec,
                   vt=vec, g=plgpu.SMEM((2, K), F32), fl=plgpu.SMEM((2, FLAGS), jnp.int32),
                   ds_out=smem((BV, K), BF16), du_out=smem((C, BV), BF16),
                   doc_buf=plgpu.SMEM((BV, K), F32), doc_bar=plgpu.Barrier(),
                   in_bar=plgpu.Barrier(num_arrivals=11 + form_a, num_barriers=2))
    scratch.update(dict(p=smem((C, C), BF16), g_r=vec, g_c=vec) if form_a else
                   dict(a=smem((2, C, BV), BF16)))
    args = [T, k, kw, q] + ([] if form_a else [A]) + [do, vecs, gc, _flags(doc, first, last),
                                                     _doc_states(dfinal)]

    def body(*refs, t, k, kw, q, dout, vbg, vg, vt, g, fl, ds_out, du_out, doc_buf, doc_bar,
             in_bar, a=None, p=None, g_r=None, g_c=None):
        refs = list(refs)
        T_ref, k_ref, kw_ref, q_ref = (refs.pop(0) for _ in range(4))
        A_ref = None if form_a else refs.pop(0)
        (do_ref, vec_ref, gc_ref, f_ref, dfinal_ref, dU_ref, dstates_ref, dinit_ref) = refs
        b, h, v0 = _start(doc_buf)

        def issue(c, slot):
            bar = in_bar.at[slot]
            rows = [(BETA_GAMMA, vbg), (GAMMA, vg), (TAIL, vt)]
            rows += [(LOG_GAMMA, g_r), (LOG_GAMMA, g_c)] if form_a else []
            _issue(c, slot, bar, (b, h, v0),
                   [(T_ref, t, None), (k_ref, k, "all"), (kw_ref, kw, "all"), (q_ref, q, "all"),
                    (do_ref, dout, "v")], vec_ref, rows)
            if not form_a:
                plgpu.copy_gmem_to_smem(A_ref.at[b, h, pl.ds(c * C, C), pl.ds(v0, BV)],
                                        a.at[slot], bar)
            plgpu.copy_gmem_to_smem(gc_ref.at[b, h, c], g.at[slot], bar)
            plgpu.copy_gmem_to_smem(f_ref.at[b, c], fl.at[slot], bar)

        def step(c, slot, dS):
            d, is_first, is_last = fl[slot, 0], fl[slot, 1], fl[slot, 2]
            dS = dS * (1 - is_last).astype(F32) + _doc_state_in(
                dfinal_ref, d, h, v0, doc_buf, doc_bar, is_last) * is_last.astype(F32)
            ds_lo = dS.astype(BF16)
            if form_a:  # P (the last step's product read its buffer: waited), then Aᵀ = dOᵀ P
                qk = matmul([(q.at[slot], kw.at[slot].T)], (C, C), None, interpret)  # Q K̃ᵀ
                _stage_p(qk, g_r, g_c, slot, p)
                do_lo = plgpu.load(dout.at[slot].T, layout=WGMMA).astype(BF16)
                dsk_t, pdo_t = products([(ds_lo, kw.at[slot].T, (BV, C)), (do_lo, p, (BV, C))],
                                        interpret)  # dSᵀ K̃ᵀ, dOᵀ P
                a_t = scale * pdo_t
            else:
                a_t = plgpu.load(a.at[slot].T, layout=WGMMA).astype(F32)
                dsk_t = matmul([(ds_lo, kw.at[slot].T)], (BV, C), None, interpret)  # dSᵀ K̃ᵀ
            dr_lo = (a_t + dsk_t * columns(vt, slot)).astype(BF16)
            store_cotangents(ds_lo, dr_lo, (ds_out, du_out), (dstates_ref, dU_ref), (b, h, v0),
                             c, pending=0)
            drt_t = matmul([(dr_lo, t.at[slot])], (BV, C), None, interpret)  # dRᵀ T
            w_lo = (drt_t * columns(vbg, slot)).astype(BF16)
            do_t = plgpu.load(dout.at[slot].T, layout=WGMMA).astype(F32)
            g_lo = (scale * do_t * columns(vg, slot)).astype(BF16)
            decay = columns(g, slot)
            dS = matmul([(-w_lo, k.at[slot]), (g_lo, q.at[slot])], (BV, K), dS * decay,
                        interpret)
            return restart_cotangent(dS, dinit_ref, d, h, v0, doc_buf, is_first)

        _loop(nc, True, issue, in_bar, step, K)

    return backward_call(body, "state_bwd_wy_mosaic", out_type, scratch, (B, H, V // BV),
                         interpret, args)
