"""The OSGM / OSDN d scan's token loops (SPEC 3.1) as Mosaic GPU kernels (Hopper): the forward
(below) and the reverse one (``osgm_bwd``).

One CTA a (batch row, head), one warpgroup, each of its 128 threads one coordinate of d
(float32, a register): per token, with s = k ⊙ k and the per-token coefficients w = η g / n̄,
g (β or 1) and r from XLA,

    a = ⟨d, s⟩ (a warpgroup reduction)     u = w (1 − g a)
    out_t = d ⊙ k (or d itself)           d ← clip(r d + u s, d_min, d_max)

the arithmetic of ``osgm_triton``'s forward (its Σ s and the division too, in XLA here). The
keys and coefficients arrive by TMA in tiles of ``TILE`` tokens, double-buffered (the next
tile's loads fly during this one's loop), and the outputs leave by TMA from double-buffered
tiles: no global load or store waits on the per-token chain, whose length is one reduction,
two scalar operations and the update (``osgm_triton``'s one-warp programs load each token's
rows from global memory inside the loop). T is padded to a whole tile (k = 0, w = 0, r = 1 leave
d as it is); K = 128 (one coordinate a thread). Packed documents (``packed``: the rows carry
each token's document and first / last flags) restart d from the document's initial state at
its first token and store its final state after its last, as ``osgm_triton`` does. In
interpret mode (``plgpu.InterpretGPUParams``) the same program runs on the CPU.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.state_mosaic import kernel
from pallas_kernels.triton_common import out_struct

F32 = jnp.float32
K_THREADS = 128  # the head dim the kernels take: one coordinate a thread of a warpgroup
TILE = 64  # tokens a TMA tile of the forward; T is padded to a multiple of it
BWD_TILE = 32  # the backward's (six tiles of 32 fit 227 KB of shared memory with f32 keys)
R, RB = 2, 1  # the retention row of the forward's coefficients (w, g, r) and the backward's
#               (u, r, w g, c_n); with packed documents three more follow: document, first, last
VEC = plgpu.Layout.WG_STRIDED((K_THREADS,), vec_size=1)


def runs(*, K: int) -> bool:
    """Whether the kernels take a call: a head dim padded to 128."""
    return K == K_THREADS


def _rows(rows, docs, Tp, ones):
    """Per-token rows [B, T, H] each (then, if ``docs``, its three rows: each token's document
    id and first / last flags [B, T]) as [B, H, n, Tp] float32, padded with zeros (no document
    flags) but row ``ones`` with ones."""
    B, T, H = rows[0].shape
    rows = list(rows) + ([] if docs is None else [jnp.broadcast_to(
        x.astype(F32)[..., None], (B, T, H)) for x in docs])
    x = jnp.pad(jnp.stack(rows, axis=1), [(0, 0), (0, 0), (0, Tp - T), (0, 0)])
    return jnp.transpose(x.at[:, ones, T:].set(1.0), (0, 3, 1, 2))


def coefficient_rows(coefs, Tp, docs=None):
    """The forward's [B, H, 3 (+ 3), Tp] from ``coefs`` = (s, n̄, g, w, r) [B, T, H(, K)]
    (``osgm_picard.coefficients``): w, g, r per token, padded to Tp tokens with w = 0, g = 0,
    r = 1; ``docs`` (document ids, first and last flags [B, T]) for packed documents."""
    _, _, g, w, r = coefs
    return _rows([w, g, r], docs, Tp, R)


def backward_rows(coefs, d, eps, Tp, docs=None):
    """The backward's [B, H, 4 (+ 3), Tp] from ``coefs`` (as ``coefficient_rows``'s) and the
    forward's d_t: u = w (1 − g a), r, w g and [n̄ > ε] (1 − g a) w / n̄ (a = ⟨d_t, s_t⟩;
    padded with zeros but r = 1: with d padded strictly inside the box, a padded token passes
    λ on unchanged), and a [B, T, H]; ``docs`` as ``coefficient_rows``'s."""
    s, n, g, w, r = coefs
    a = jnp.sum(d * s, -1)
    v = 1.0 - g * a
    return _rows([w * v, r, w * g, jnp.where(n > eps, v * w / n, 0.0)], docs, Tp, RB), a


def padded_length(T):
    """T rounded up to whole tiles."""
    return -(-T // TILE) * TILE


def _check(name, K, Tp):
    if K != K_THREADS or Tp % TILE:
        raise ValueError(f"osgm_mosaic.{name} takes K = {K_THREADS} and T a multiple of {TILE}, "
                         f"got K={K}, T={Tp}")


def _walk(n_tiles, reverse, issue, in_bar, start_bar, state, start, end, run_tile,
          store_tile):
    """The tile loop of a CTA: ``n_tiles`` tiles in order (descending if ``reverse``),
    double-buffered (slot j % 2 for the j-th walked; ``issue(i, slot)`` sends tile i's copies
    to ``in_bar[slot]``, the next tile's right after this one's arrived), the carry (one
    coordinate a thread) from the GMEM ref ``start`` (by ``start_bar``) through ``state`` to
    ``end``;
    ``run_tile(i, slot, carry)`` returns the next carry after writing the tile's outputs into
    slot ``slot``, which ``store_tile(i, slot)`` sends (one commit group a tile: the slot is
    reused once the group of two tiles before has been read)."""
    at = (lambda j: n_tiles - 1 - j) if reverse else (lambda j: j)
    issue(at(0), 0)
    plgpu.copy_gmem_to_smem(start, state, start_bar)
    plgpu.barrier_wait(start_bar)

    def body(j, carry):
        i, slot = at(j), lax.rem(j, 2)
        plgpu.barrier_wait(in_bar.at[slot])

        @pl.when(j + 1 < n_tiles)
        def _next():
            issue(at(j + 1), 1 - slot)

        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's last outputs were sent
        carry = run_tile(i, slot, carry)
        plgpu.commit_smem()
        store_tile(i, slot)
        return carry

    carry = lax.fori_loop(0, n_tiles, body, plgpu.load(state, layout=VEC))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if end is not None:
        state[...] = carry
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state, end)
    plgpu.wait_smem_to_gmem(0)


def _document_in(value, ref, h, doc, flag, buf, bar):
    """``value``, or document ``doc``'s row of ``ref`` [N, H, 128] (loaded into ``buf``) where
    ``flag`` is set (a document boundary)."""
    @pl.when(flag != 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # buf's last store was read
        plgpu.copy_gmem_to_smem(ref.at[doc, h], buf, bar)
        plgpu.barrier_wait(bar)

    on = plgpu.layout_cast(jnp.broadcast_to(flag != 0, (K_THREADS,)), VEC)
    return jnp.where(on, plgpu.load(buf, layout=VEC), value)


def _document_out(value, ref, h, doc, flag, buf):
    """Document ``doc``'s row of ``ref`` [N, H, 128] = ``value`` where ``flag`` is set."""
    @pl.when(flag != 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        buf[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, ref.at[doc, h])


def _kernel(body, name, out_type, scratch, B, H, interpret, args, arrivals):
    """One CTA a (row, head) with ``scratch`` plus the state buffer, the barriers (two tile
    slots of ``arrivals`` copies, one for single rows) and a document-state buffer."""
    scratch = dict(scratch, state=plgpu.SMEM((K_THREADS,), F32), start_bar=plgpu.Barrier(),
                   in_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
                   doc_buf=plgpu.SMEM((K_THREADS,), F32))
    return kernel(body, name=name, out_type=out_type, scratch=scratch, grid=(B, H),
                  interpret=interpret, grid_names=("b", "h"))(*args)


def _clip(p, d_min, d_max):
    """``reference.osgm.clip_box``'s values."""
    return jnp.where(p >= d_max, d_max, jnp.where(p <= d_min, d_min, p))


def _issue(position, i, n, slot, bar, tiles, rows, c_ref, bufs):
    """TMA copies of tile i (``n`` tokens) into ``slot``: each (GMEM ref [B, Tp, H, 128], SMEM
    buffer) of ``tiles``, and row ``rows[j]`` of the coefficients ``c_ref`` into ``bufs[j]``."""
    b, h = position
    tokens = pl.ds(i * n, n)
    for src, dst in tiles:
        plgpu.copy_gmem_to_smem(src.at[b, tokens, h], dst.at[slot], bar.at[slot])
    for row, buf in zip(rows, bufs):
        plgpu.copy_gmem_to_smem(c_ref.at[b, h, row, tokens], buf.at[slot], bar.at[slot])


def _doc_scratch(packed, vec):
    """The document rows' buffers (ids, first and last flags) when ``packed``."""
    return dict(doc=vec, first=vec, last=vec) if packed else {}


def osgm_fwd(k, coefs, initial_state, *, bounds, emit_d, interpret, packed=False):
    """k [B, Tp, H, 128] (Tp a multiple of TILE), coefs [B, H, 3 (+ 3 if ``packed``), Tp]
    (``coefficient_rows``), initial_state [N, H, 128] float32 (N = B, or the documents);
    bounds (d_min, d_max). Returns (k̃ [B, Tp, H, 128] in k's dtype, or every d_t float32 if
    ``emit_d``; final d [N, H, 128] float32)."""
    B, Tp, H, K = k.shape
    _check("osgm_fwd", K, Tp)
    d_min, d_max = bounds
    out_dtype = F32 if emit_d else k.dtype
    ins = (k, coefs, initial_state)
    out_type = (out_struct((B, Tp, H, K), out_dtype, *ins),
                out_struct(initial_state.shape, F32, *ins))
    vec = plgpu.SMEM((2, TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, TILE, K), k.dtype), w=vec, g=vec, r=vec,
                   out=plgpu.SMEM((2, TILE, K), out_dtype), **_doc_scratch(packed, vec))
    rows = range(6 if packed else 3)

    def body(k_ref, c_ref, init_ref, out_ref, final_ref, *, k, w, g, r, out, state, start_bar,
             in_bar, doc_buf, doc=None, first=None, last=None):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = (w, g, r) + ((doc, first, last) if packed else ())

        def issue(i, slot):
            _issue((b, h), i, TILE, slot, in_bar, [(k_ref, k)], rows, c_ref, bufs)

        def run_tile(i, slot, d):
            def token(t, d):
                if packed:
                    doc_t = doc[slot, t].astype(jnp.int32)
                    d = _document_in(d, init_ref, h, doc_t, first[slot, t], doc_buf, start_bar)
                k_t = plgpu.load(k.at[slot, t], layout=VEC).astype(F32)
                s = k_t * k_t
                a = jnp.sum(d * s)
                out.at[slot, t][...] = d if emit_d else (d * k_t).astype(out_dtype)
                u = w[slot, t] * (1.0 - g[slot, t] * a)
                d = _clip(r[slot, t] * d + u * s, d_min, d_max)
                if packed:
                    _document_out(d, final_ref, h, doc_t, last[slot, t], doc_buf)
                return d

            return lax.fori_loop(0, TILE, token, d, unroll=8)

        def store_tile(i, slot):
            plgpu.copy_smem_to_gmem(out.at[slot], out_ref.at[b, pl.ds(i * TILE, TILE), h])

        _walk(Tp // TILE, False, issue, in_bar, start_bar, state,
              init_ref.at[0 if packed else b, h], None if packed else final_ref.at[b, h],
              run_tile, store_tile)

    return _kernel(body, "osgm_fwd_mosaic", out_type, scratch, B, H, interpret, ins, len(rows) + 1)


def osgm_bwd(k, d, dkw, coefs, dfinal, *, bounds, interpret, packed=False):
    """The reverse token loop (``osgm_triton``'s backward, one coordinate a thread, tiles in
    reverse): with λ = ∂L/∂d_{t+1}, μ = λ ⊙ [d_min < r d + u s < d_max] and γ = ⟨μ, s⟩,

        ∂k_t = 2 k (u μ − γ (w g) d − γ c_n) + ∂k̃ ⊙ d      ∂r_t = ⟨μ, d⟩
        λ ← r μ − γ (w g) s + ∂k̃ ⊙ k

    (with ``packed`` documents λ = dfinal[doc] at a document's last token, and ∂d_1[doc] the λ
    after its first) from k, d (every d_t, float32) and ∂k̃ [B, Tp, H, 128], coefs [B, H,
    4 (+ 3), Tp] (``backward_rows``) and dfinal [N, H, 128]. Returns (∂k [B, Tp, H, 128]
    float32, rows (γ, ∂r) [B, H, 2, Tp] float32, ∂d_1 [N, H, 128])."""
    B, Tp, H, K = k.shape
    _check("osgm_bwd", K, Tp)
    d_min, d_max = bounds
    ins = (k, d, dkw, coefs, dfinal)
    out_type = (out_struct((B, Tp, H, K), F32, *ins), out_struct((B, H, 2, Tp), F32, *ins),
                out_struct(dfinal.shape, F32, *ins))
    vec, n = plgpu.SMEM((2, BWD_TILE), F32), BWD_TILE
    scratch = dict(k=plgpu.SMEM((2, n, K), k.dtype), d=plgpu.SMEM((2, n, K), F32),
                   dkw=plgpu.SMEM((2, n, K), dkw.dtype), u=vec, r=vec, gw=vec, gn=vec,
                   dk=plgpu.SMEM((2, n, K), F32), gam=vec, dr=vec, **_doc_scratch(packed, vec))
    rows = range(7 if packed else 4)

    def body(k_ref, d_ref, dkw_ref, c_ref, dfinal_ref, dk_ref, rows_ref, dinit_ref, *, k, d,
             dkw, u, r, gw, gn, dk, gam, dr, state, start_bar, in_bar, doc_buf, doc=None,
             first=None, last=None):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = (u, r, gw, gn) + ((doc, first, last) if packed else ())

        def issue(i, slot):
            _issue((b, h), i, n, slot, in_bar, [(k_ref, k), (d_ref, d), (dkw_ref, dkw)], rows,
                   c_ref, bufs)

        def run_tile(i, slot, lam):
            def token(tt, lam):
                t = n - 1 - tt
                if packed:
                    doc_t = doc[slot, t].astype(jnp.int32)
                    lam = _document_in(lam, dfinal_ref, h, doc_t, last[slot, t], doc_buf,
                                       start_bar)
                k_t = plgpu.load(k.at[slot, t], layout=VEC).astype(F32)
                d_t = plgpu.load(d.at[slot, t], layout=VEC)
                dkw_t = plgpu.load(dkw.at[slot, t], layout=VEC).astype(F32)
                s = k_t * k_t
                u_t, r_t = u[slot, t], r[slot, t]
                p = r_t * d_t + u_t * s
                mu = jnp.where((p > d_min) & (p < d_max), lam, 0.0)
                gu = jnp.sum(mu * s)
                ga, g_n = -gu * gw[slot, t], -gu * gn[slot, t]
                dk.at[slot, t][...] = 2.0 * k_t * (u_t * mu + ga * d_t + g_n) + dkw_t * d_t
                gam[slot, t] = gu
                dr[slot, t] = jnp.sum(mu * d_t)
                lam = r_t * mu + ga * s + dkw_t * k_t
                if packed:
                    _document_out(lam, dinit_ref, h, doc_t, first[slot, t], doc_buf)
                return lam

            return lax.fori_loop(0, n, token, lam, unroll=8)

        def store_tile(i, slot):
            tokens = pl.ds(i * n, n)
            plgpu.copy_smem_to_gmem(dk.at[slot], dk_ref.at[b, tokens, h], commit_group=False)
            plgpu.copy_smem_to_gmem(gam.at[slot], rows_ref.at[b, h, 0, tokens],
                                    commit_group=False)
            plgpu.copy_smem_to_gmem(dr.at[slot], rows_ref.at[b, h, 1, tokens],
                                    commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        _walk(Tp // n, True, issue, in_bar, start_bar, state,
              dfinal_ref.at[0 if packed else b, h], None if packed else dinit_ref.at[b, h],
              run_tile, store_tile)

    return _kernel(body, "osgm_bwd_mosaic", out_type, scratch, B, H, interpret, ins, len(rows) + 3)
