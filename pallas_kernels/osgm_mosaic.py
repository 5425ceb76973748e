"""The OSGM / OSDN d scan (SPEC 3.1) as Mosaic GPU kernels (Hopper), forward (``osgm_fwd``)
and reverse (``osgm_bwd``), by Picard iteration inside tiles of 64 tokens.

The coordinates of d interact only through the scalar a_t = ⟨d_t, s_t⟩ (s = k ⊙ k): given
a_t, each coordinate is its own clipped affine recurrence. One CTA a (batch row, head), one
warpgroup, each of its 128 threads one coordinate; per tile of ``TILE`` tokens, from the exact
state d_0 entering it and the per-token w = η g / n̄, g (β or 1), r from XLA:

    a_t ← ⟨d_0, s_t⟩                                           (the first guess)
    repeat:  u_t = w_t (1 − g_t a_t)
             a sweep, thread j alone:  D_tj = d_j;  d_j ← clip(r_t d_j + u_t s_tj, d_min, d_max)
             a'_t = Σ_j D_tj s_tj   (row sums of the tile in the WGMMA layout)
    until a' = a bit for bit;  then k̃_t = D_t ⊙ k_t (or d_t itself), and the tile's last d
    enters the next.

No reduction sits on the per-token chain (one FMA and the clip). Causality bounds the sweeps:
after the n-th, a_1 .. a_n equal the fixed point's, so it is reached within TILE sweeps and
confirmed by one more; as the coupling w g ⟨s_τ, s_t⟩ is small (η = 0.003), it takes a few
(``chunked/osgm_picard.py``). The result is the token loop's with the row sums' order of
summation, whatever the number of sweeps. The reverse kernel does the same for the adjoint,
whose coordinates interact only through γ_t = ⟨μ_t, s_t⟩; it recomputes each tile's d_t by one
sweep from the tile's entering state and the u_t the forward ended with (its residuals, instead
of every d_t).

Keys and coefficient rows arrive by TMA in double-buffered tiles; outputs leave by TMA. T is
padded to whole tiles (k = 0, w = 0, r = 1 leave d as it is); K = 128. Packed documents
(``packed``: the rows carry each token's document and first / last flags) restart d (λ) from
the document's state at its first (last) token: the restart rows are copied by TMA into the
tile's row buffer before the sweeps, which read them there. In interpret mode
(``plgpu.InterpretGPUParams``) the same program runs on the CPU.
"""

import functools

import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.state_mosaic import COLS, ROWS, WGMMA, bcast_cols, bcast_rows, kernel
from pallas_kernels.triton_common import out_struct

F32 = jnp.float32
K_THREADS = 128  # the head dim the kernels take: one coordinate a thread of a warpgroup
TILE = 64  # tokens a tile (the rows of the WGMMA layout); T is padded to a multiple of it
W, G, R = 0, 1, 2  # the forward's coefficient rows; with packed documents three more follow:
U, RB, WG, GN = 0, 1, 2, 3  # document, first, last; and the backward's
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


def backward_rows(coefs, u, a, eps, Tp, docs=None):
    """The backward's [B, H, 4 (+ 3), Tp] from ``coefs`` (as ``coefficient_rows``'s) and the
    forward's u_t, a_t [B, T, H]: u, r, w g and [n̄ > ε] (1 − g a) w / n̄, padded with zeros but
    r = 1 (a padded token passes λ on unchanged); ``docs`` as ``coefficient_rows``'s."""
    _, n, g, w, r = coefs
    return _rows([u, r, w * g, jnp.where(n > eps, (1.0 - g * a) * w / n, 0.0)], docs, Tp, RB)


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
    ``end``; ``run_tile(i, slot, carry)`` returns the next carry after writing the tile's
    outputs into slot ``slot``, which ``store_tile(i, slot)`` sends (one commit group a tile:
    the slot is reused once the group of two tiles before has been read)."""
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
        plgpu.commit_smem()  # (one thread waited: the others wait for it here)
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


def _restart_rows(ref, h, doc, flag, rows, bar):
    """Row t of ``rows`` [TILE, 128] = document ``doc[t]``'s row of ``ref`` [N, H, 128] for
    every token t whose ``flag`` is set (by TMA, one copy at a time: documents are rare)."""
    plgpu.commit_smem()  # the rows' last readers are done before TMA writes them

    def token(t, _):
        @pl.when(flag[t] != 0)
        def _():
            plgpu.copy_gmem_to_smem(ref.at[doc[t].astype(jnp.int32), h], rows.at[t], bar)
            plgpu.barrier_wait(bar)

    lax.fori_loop(0, TILE, token, None)


def _document_out(value, ref, h, doc, flag, buf):
    """Document ``doc``'s row of ``ref`` [N, H, 128] = ``value`` where ``flag`` is set."""
    @pl.when(flag != 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.commit_smem()  # every thread waits for the one that waited
        buf[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, ref.at[doc, h])


def _flag(x):
    """A per-token flag (a float row entry) as a VEC-layout mask."""
    return plgpu.layout_cast(jnp.broadcast_to(x != 0, (K_THREADS,)), VEC)


def _kernel(body, name, out_type, scratch, B, H, interpret, args, arrivals):
    """One CTA a (row, head) with ``scratch`` plus the state buffer, the barriers (two tile
    slots of ``arrivals`` copies, one for single rows) and a document-state buffer."""
    scratch = dict(scratch, state=plgpu.SMEM((K_THREADS,), F32), start_bar=plgpu.Barrier(),
                   in_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
                   doc_buf=plgpu.SMEM((K_THREADS,), F32))
    return kernel(body, name=name, out_type=out_type, scratch=scratch, grid=(B, H),
                  interpret=interpret, grid_names=("b", "h"), auto_barriers=False)(*args)


def _clip(p, d_min, d_max):
    """``reference.osgm.clip_box``'s values."""
    return jnp.where(p >= d_max, d_max, jnp.where(p <= d_min, d_min, p))


def _row(ref):
    """A [128] shared-memory row, one coordinate a thread, as float32."""
    return plgpu.load(ref, layout=VEC).astype(F32)


def _affine(r_t, x, u_t, k_t):
    """r_t x + u_t (k_t ⊙ k_t) (k_t a float32 key row): for x = d, the argument of token t's
    clip; for x = μ and u_t the coupling c_t, the adjoint's step less its ∂k̃ ⊙ k term."""
    return r_t * x + u_t * (k_t * k_t)


def _issue(position, i, slot, bar, tiles, rows, c_ref, bufs, singles=()):
    """TMA copies of tile i into ``slot``: each (GMEM ref [B, Tp, H, 128], SMEM buffer) of
    ``tiles``, row ``rows[j]`` of the coefficients ``c_ref`` into ``bufs[j]``, and each (GMEM
    ref [B, n_tiles, H, 128], SMEM buffer) of ``singles`` (one row a tile)."""
    b, h = position
    tokens = pl.ds(i * TILE, TILE)
    for src, dst in tiles:
        plgpu.copy_gmem_to_smem(src.at[b, tokens, h], dst.at[slot], bar.at[slot])
    for row, buf in zip(rows, bufs):
        plgpu.copy_gmem_to_smem(c_ref.at[b, h, row, tokens], buf.at[slot], bar.at[slot])
    for src, dst in singles:
        plgpu.copy_gmem_to_smem(src.at[b, i, h], dst.at[slot], bar.at[slot])


def _send(position, i, tiles, rows_ref, row_bufs, singles=()):
    """TMA stores of tile i's results, one commit group: each (SMEM buffer, GMEM ref [B, Tp, H,
    128]) of ``tiles``, ``row_bufs[j]`` into row j of ``rows_ref`` [B, H, n, Tp], and each (SMEM
    buffer, GMEM ref [B, n_tiles, H, 128]) of ``singles``."""
    b, h = position
    tokens = pl.ds(i * TILE, TILE)
    copies = [(src, dst.at[b, tokens, h]) for src, dst in tiles]
    copies += [(buf, rows_ref.at[b, h, j, tokens]) for j, buf in enumerate(row_bufs)]
    copies += [(src, dst.at[b, i, h]) for src, dst in singles]
    for src, dst in copies:
        plgpu.copy_smem_to_gmem(src, dst, commit_group=False)
    plgpu.commit_smem_to_gmem_group()


def _doc_scratch(packed, vec):
    """The document rows' buffers (ids, first and last flags) when ``packed``."""
    return dict(doc=vec, first=vec, last=vec) if packed else {}


@functools.cache
def _wgmma_load(dtype):
    """An ``inline_mgpu`` load of a [TILE, 128] shared-memory tile of ``dtype`` in the WGMMA
    layout."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=plgpu.ShapeDtypeStruct(
        (TILE, K_THREADS), dtype, layout=WGMMA))
    def load(ctx, ref):
        del ctx
        return mgpu.FragmentedArray.load_untiled(ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)
    return load


@plgpu.inline_mgpu(arg_types=(WGMMA, plgpu.RefType()))
def _wgmma_store(ctx, x, ref):
    """``ref`` [TILE, 128] float32 = x (WGMMA layout), in ``inline_mgpu``."""
    del ctx
    x.store_untiled(ref, optimized=False)


def _tile(ref, interpret):
    """A [TILE, 128] shared-memory tile as float32 in the WGMMA layout. The buffers the sweeps
    also read or write by rows (one coordinate a thread) are loaded whole in ``inline_mgpu``:
    through ``plgpu.load``, both uses of one buffer send Pallas's layout inference into a
    search that runs out of fuel after ten minutes."""
    x = ref[...] if interpret else _wgmma_load(ref.dtype)(ref)
    return x.astype(F32)


def _set_tile(ref, x, interpret):
    """``ref`` [TILE, 128] float32 = x (WGMMA layout), as ``_tile`` loads."""
    if interpret:
        ref[...] = x
    else:
        _wgmma_store(x, ref)


def _squares(k_tile, interpret):
    """s = k ⊙ k of a tile [TILE, 128] in the WGMMA layout, float32."""
    k = _tile(k_tile, interpret)
    return k * k


def _row_sums(x_tile, s, interpret):
    """Σ_j X_tj s_tj [TILE] (ROWS layout) of a float32 tile in shared memory."""
    return jnp.sum(_tile(x_tile, interpret) * s, axis=1)


def _changed(new, old):
    """Whether two ROWS vectors differ anywhere (a scalar)."""
    return jnp.sum(jnp.where(new != old, 1.0, 0.0)) > 0.0


def _settle(step, x0, carry0):
    """Picard sweeps ``x, carry = step(x)`` from the guess x0 until x comes back bit for bit (at
    most TILE + 1: causality settles one more token a sweep). Returns (x, carry)."""
    def cond(c):
        return c[2] & (c[3] <= TILE)

    def body(c):
        x, _, _, n = c
        x_new, carry = step(x)
        return x_new, carry, _changed(x_new, x), n + 1

    x, carry, _, _ = lax.while_loop(cond, body, (x0, carry0, jnp.bool_(True), jnp.int32(0)))
    return x, carry


def _unroll(interpret):
    """Tokens a loop iteration of the sweeps: 8 compiled (their loads issued ahead of the
    chain), 1 in interpret mode (XLA compiles the interpreted loop's body once, not 8 times)."""
    return 1 if interpret else 8


def _forward_sweep(d0, k_tile, u, r, D, bounds, interpret, first=None):
    """d_t of the tile's tokens into the rows of ``D`` (a document's first token: the restart
    row already there) for the per-token u_t, r_t (shared-memory rows); returns the state after
    the tile."""
    def token(t, d):
        if first is not None:
            d = jnp.where(_flag(first[t]), _row(D.at[t]), d)
        D.at[t][...] = d
        return _clip(_affine(r[t], d, u[t], _row(k_tile.at[t])), *bounds)

    return lax.fori_loop(0, TILE, token, d0, unroll=_unroll(interpret))


def osgm_fwd(k, coefs, initial_state, *, bounds, interpret, packed=False, residuals=False):
    """k [B, Tp, H, 128] (Tp a multiple of TILE), coefs [B, H, 3 (+ 3 if ``packed``), Tp]
    (``coefficient_rows``), initial_state [N, H, 128] float32 (N = B, or the documents);
    bounds (d_min, d_max). Returns k̃ [B, Tp, H, 128] in k's dtype and the final d [N, H, 128]
    float32; with ``residuals`` also the rows (u_t, a_t) [B, H, 2, Tp] and the state entering
    each tile [B, Tp / TILE, H, 128] float32 (``osgm_bwd``'s inputs)."""
    B, Tp, H, K = k.shape
    _check("osgm_fwd", K, Tp)
    ins = (k, coefs, initial_state)
    out_type = (out_struct((B, Tp, H, K), k.dtype, *ins),
                out_struct(initial_state.shape, F32, *ins))
    if residuals:
        out_type += (out_struct((B, H, 2, Tp), F32, *ins),
                     out_struct((B, Tp // TILE, H, K), F32, *ins))
    vec = plgpu.SMEM((2, TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, TILE, K), k.dtype), w=vec, g=vec, r=vec, u=vec, a=vec,
                   out=plgpu.SMEM((2, TILE, K), k.dtype), D=plgpu.SMEM((TILE, K), F32),
                   starts=plgpu.SMEM((2, K), F32), **_doc_scratch(packed, vec))
    rows = range(6 if packed else 3)

    def body(k_ref, c_ref, init_ref, out_ref, final_ref, *res_refs, k, w, g, r, u, a, out, D,
             starts, state, start_bar, in_bar, doc_buf, doc=None, first=None, last=None):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = (w, g, r) + ((doc, first, last) if packed else ())

        def issue(i, slot):
            _issue((b, h), i, slot, in_bar, [(k_ref, k)], rows, c_ref, bufs)

        def run_tile(i, slot, d0):
            k_tile, u_t = k.at[slot], u.at[slot]
            s = _squares(k_tile, interpret)
            starts.at[slot][...] = d0
            if packed:
                _restart_rows(init_ref, h, doc.at[slot], first.at[slot], D, start_bar)
            plgpu.commit_smem()
            w_row, g_row = plgpu.load(w.at[slot], layout=ROWS), plgpu.load(g.at[slot], layout=ROWS)
            guess = jnp.sum(s * bcast_cols(plgpu.load(starts.at[slot], layout=COLS), s.shape),
                            axis=1)

            def step(a_t):
                u_t[...] = w_row * (1.0 - g_row * a_t)
                plgpu.commit_smem()
                d = _forward_sweep(d0, k_tile, u_t, r.at[slot], D, bounds, interpret,
                                   first.at[slot] if packed else None)
                plgpu.commit_smem()
                return _row_sums(D, s, interpret), d

            a_t, d = _settle(step, guess, d0)
            a.at[slot][...] = a_t
            out.at[slot][...] = (_tile(D, interpret) * _tile(k_tile, interpret)).astype(k.dtype)
            if packed:  # each document ending here: its state after its last token
                def ends(t, _):
                    value = _clip(_affine(r[slot, t], _row(D.at[t]), u_t[t],
                                          _row(k_tile.at[t])), *bounds)
                    _document_out(value, final_ref, h, doc[slot, t].astype(jnp.int32),
                                  last[slot, t], doc_buf)
                lax.fori_loop(0, TILE, ends, None)
            return d

        def store_tile(i, slot):
            rows_ref, starts_ref = res_refs if residuals else (None, None)
            _send((b, h), i, [(out.at[slot], out_ref)], rows_ref,
                  (u.at[slot], a.at[slot]) if residuals else (),
                  [(starts.at[slot], starts_ref)] if residuals else ())

        _walk(Tp // TILE, False, issue, in_bar, start_bar, state,
              init_ref.at[0 if packed else b, h], None if packed else final_ref.at[b, h],
              run_tile, store_tile)

    return _kernel(body, "osgm_fwd_mosaic", out_type, scratch, B, H, interpret, ins, len(rows) + 1)


def osgm_bwd(k, dkw, coefs, starts, init, dfinal, *, bounds, interpret, packed=False):
    """The reverse scan by Picard sweeps per tile (tiles in reverse): with λ = ∂L/∂d_{t+1},
    μ = λ ⊙ [d_min < r d + u s < d_max], γ = ⟨μ, s⟩ (the sweeps' coupling),

        ∂k_t = 2 k (u μ − γ (w g) d − γ c_n) + ∂k̃ ⊙ d      ∂r_t = ⟨μ, d⟩
        λ ← r μ − γ (w g) s + ∂k̃ ⊙ k

    (with ``packed`` documents λ = dfinal[doc] at a document's last token, and ∂d_1[doc] the λ
    after its first), each tile's d_t recomputed by one forward sweep from ``starts`` [B,
    Tp / TILE, H, 128] and the rows' u_t. k and ∂k̃ [B, Tp, H, 128], coefs [B, H, 4 (+ 3), Tp]
    (``backward_rows``), init (the documents' initial states; read with ``packed`` only) and
    dfinal [N, H, 128]. Padded tokens (k = 0, r = 1) mask λ by [d_min < d < d_max] for the
    final d, as the last real token's clip derivative does already. Returns (∂k [B, Tp, H,
    128] float32, rows (γ, ∂r) [B, H, 2, Tp] float32, ∂d_1 [N, H, 128])."""
    B, Tp, H, K = k.shape
    _check("osgm_bwd", K, Tp)
    d_min, d_max = bounds
    ins = (k, dkw, coefs, starts, init, dfinal)
    out_type = (out_struct((B, Tp, H, K), F32, *ins), out_struct((B, H, 2, Tp), F32, *ins),
                out_struct(dfinal.shape, F32, *ins))
    vec = plgpu.SMEM((2, TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, TILE, K), k.dtype), dkw=plgpu.SMEM((2, TILE, K), dkw.dtype),
                   st=plgpu.SMEM((2, K), F32), u=vec, r=vec, gw=vec, gn=vec,
                   c=plgpu.SMEM((TILE,), F32), gam=vec, dr=vec, D=plgpu.SMEM((TILE, K), F32),
                   M=plgpu.SMEM((TILE, K), F32), **_doc_scratch(packed, vec))
    rows = range(7 if packed else 4)

    def body(k_ref, dkw_ref, c_ref, st_ref, init_ref, dfinal_ref, dk_ref, rows_ref, dinit_ref,
             *, k, dkw, st, u, r, gw, gn, c, gam, dr, D, M, state, start_bar, in_bar, doc_buf,
             doc=None, first=None, last=None):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = (u, r, gw, gn) + ((doc, first, last) if packed else ())

        def issue(i, slot):
            _issue((b, h), i, slot, in_bar, [(k_ref, k), (dkw_ref, dkw)], rows, c_ref, bufs,
                   [(st_ref, st)])

        def lam_after(t, slot, mu, k_t):
            """λ entering token t − 1 from μ_t (the coupling in ``c``; k_t the key row)."""
            return _affine(r[slot, t], mu, c[t], k_t) + _row(dkw.at[slot, t]) * k_t

        def inside(t, slot, k_t):
            """[d_min < r_t d_t + u_t s_t < d_max]: where the clip passes λ at token t."""
            p = _affine(r[slot, t], _row(D.at[t]), u[slot, t], k_t)
            return (p > d_min) & (p < d_max)

        def reverse_sweep(lam, slot):
            """μ_t into the rows of M (a document's last token: λ from the row there, whose μ
            is written once before the sweeps); returns λ before the tile."""
            def token(tt, lam):
                t = TILE - 1 - tt
                k_t = _row(k.at[slot, t])
                mu = jnp.where(inside(t, slot, k_t), lam, 0.0)
                if packed:
                    mu = jnp.where(_flag(last[slot, t]), _row(M.at[t]), mu)
                M.at[t][...] = mu
                return lam_after(t, slot, mu, k_t)

            return lax.fori_loop(0, TILE, token, lam, unroll=_unroll(interpret))

        def run_tile(i, slot, lam0):
            k_tile = k.at[slot]
            s = _squares(k_tile, interpret)
            if packed:
                _restart_rows(init_ref, h, doc.at[slot], first.at[slot], D, start_bar)
            _forward_sweep(plgpu.load(st.at[slot], layout=VEC), k_tile, u.at[slot], r.at[slot], D,
                           bounds, interpret, first.at[slot] if packed else None)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # M's ∂k of the last tile was sent
            plgpu.commit_smem()
            if packed:  # μ at each document's last token, from its dfinal row
                _restart_rows(dfinal_ref, h, doc.at[slot], last.at[slot], M, start_bar)

                def masked(t, _):
                    keep = _flag(last[slot, t]) & inside(t, slot, _row(k.at[slot, t]))
                    M.at[t][...] = jnp.where(keep, _row(M.at[t]), 0.0)
                lax.fori_loop(0, TILE, masked, None)
            plgpu.commit_smem()
            gw_row = plgpu.load(gw.at[slot], layout=ROWS)

            def step(gam_t):
                c[...] = -gam_t * gw_row
                plgpu.commit_smem()
                lam = reverse_sweep(lam0, slot)
                plgpu.commit_smem()
                return _row_sums(M, s, interpret), lam

            gam_t, lam = _settle(step, plgpu.layout_cast(jnp.zeros((TILE,), F32), ROWS), lam0)
            mu, d, k_w = (_tile(x, interpret) for x in (M, D, k_tile))
            per_row = lambda x: bcast_rows(x, mu.shape)  # noqa: E731
            ds = (per_row(plgpu.load(u.at[slot], layout=ROWS)) * mu + per_row(-gam_t * gw_row) * d
                  + per_row(-gam_t * plgpu.load(gn.at[slot], layout=ROWS)))
            dk = 2.0 * k_w * ds + _tile(dkw.at[slot], interpret) * d
            gam.at[slot][...] = gam_t
            dr.at[slot][...] = jnp.sum(mu * d, axis=1)
            if packed:  # each document starting here: the λ before its first token
                def starts_(t, _):
                    _document_out(lam_after(t, slot, _row(M.at[t]), _row(k.at[slot, t])), dinit_ref,
                                  h, doc[slot, t].astype(jnp.int32), first[slot, t], doc_buf)
                lax.fori_loop(0, TILE, starts_, None)
            plgpu.commit_smem()  # every thread done with M before it holds ∂k
            _set_tile(M, dk, interpret)
            return lam

        def store_tile(i, slot):
            _send((b, h), i, [(M, dk_ref)], rows_ref, (gam.at[slot], dr.at[slot]))

        _walk(Tp // TILE, True, issue, in_bar, start_bar, state,
              dfinal_ref.at[0 if packed else b, h], None if packed else dinit_ref.at[b, h],
              run_tile, store_tile)

    return _kernel(body, "osgm_bwd_mosaic", out_type, scratch, B, H, interpret, ins, len(rows) + 3)
