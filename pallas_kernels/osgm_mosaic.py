"""The OSGM / OSDN d scan (SPEC 3.1) as Mosaic GPU kernels (Hopper), forward (``osgm_fwd``)
and reverse (``osgm_bwd``), by Picard iteration inside tiles of 64 tokens.

The coordinates of d interact only through the scalar a_t = ⟨d_t, s_t⟩ (s = k ⊙ k): given
a_t, each coordinate is its own clipped affine recurrence. One CTA a (batch row, head), whose
sweeps' warpgroup gives each of its 128 threads one coordinate (with 16-bit inputs a second
warpgroup does the per-tile work off that chain, ``warpgroups``); per tile of ``TILE``
tokens, from the exact state d_0 entering it and the per-token w = η g / n̄, g (β or 1), r
from XLA:

    a_t ← ⟨clip(p_t d_0), s_t⟩, p_t = Π_{m<t} r_m             (the first guess)
    repeat:  u_t = w_t (1 − g_t a_t)
             a sweep, thread j alone:  D_tj = d_j;  d_j ← clip(r_t d_j + u_t s_tj, d_min, d_max)
             a'_t = Σ_j D_tj s_tj   (row sums of the tile in the WGMMA layout)
    until a' = a bit for bit, or a' − a is small enough that the D this sweep wrote is within
    a quarter float32 spacing of the fixed point's (``_accepts``: a contraction bound);
    then k̃_t = D_t ⊙ k_t (or d_t itself), and the tile's last d enters the next.

No reduction sits on the per-token chain (one FMA and the clip). Causality bounds the sweeps:
after the n-th, a_1 .. a_n equal the fixed point's, so it is reached within TILE sweeps and
confirmed by one more; as the coupling w g ⟨s_τ, s_t⟩ is small (η = 0.003), it takes a few
(``chunked/osgm_picard.py``), and the bound saves the confirming one where the coupling is
that small. The result is the token loop's with the row sums' order of summation, to within
that quarter spacing, whatever the number of sweeps. The reverse kernel does the same for the adjoint,
whose coordinates interact only through γ_t = ⟨μ_t, s_t⟩; it recomputes each tile's d_t by one
sweep from the tile's entering state and the u_t the forward ended with (its residuals, instead
of every d_t).

The machinery is ``rows_mosaic``'s: every per-token pass (s_t = k_t ⊙ k_t into S, the sweeps,
k̃ and ∂k) runs by rows, thread j at its own coordinate; the tiles read whole in the WGMMA layout
(S, D, M for the row sums) have padded rows; the loads of ``GROUP`` tokens go out before their
steps (``rows_mosaic.tokens``); keys and coefficient rows arrive by TMA in double-buffered
tiles, outputs leave by TMA. T is padded to whole tiles (k = 0, w = 0, r = 1 leave d as it
is); K = 128. Packed documents (``packed``: the rows carry each token's document and first /
last flags) restart d (λ) from the document's state at its first (last) token: the restart
rows are copied into the tile's row buffer before the sweeps, which read them there. In
interpret mode (``plgpu.InterpretGPUParams``) the same program runs on the CPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rows_mosaic import (
    F32, K_THREADS, KP, TILE, VEC, check_shape, check_warpgroups, cta_kernel, doc_scratch,
    document_out, flag_mask, issue, padded, restart_rows, row, row_sums, rows_layout,
    send, slot_tile, square_rows, tile, tokens, walk_tiles)
from pallas_kernels.state_mosaic import COLS, ROWS, bcast_cols, bcast_rows
from pallas_kernels.triton_common import out_struct

SPACING = 2.0 ** -26  # _accepts: a quarter of float32's spacing at 1 (2^-23), relative
W, G, R, P = 0, 1, 2, 3  # the forward's rows; with packed documents three more follow:
U, RB, WG, GN = 0, 1, 2, 3  # document, first, last; and the backward's


def runs(*, K: int) -> bool:
    """Whether the kernels take a call: a head dim padded to 128."""
    return K == K_THREADS


def coefficient_rows(coefs, Tp, docs=None):
    """The forward's [B, H, 4 (+ 3), Tp] from ``coefs`` = (s, n̄, g, w, r) [B, T, H(, K)]
    (``osgm_picard.coefficients``): w, g, r and ``retained(r)`` per token, padded to Tp tokens
    with w = 0, g = 0, r = 1; ``docs`` (document ids, first and last flags [B, T]) for packed
    documents."""
    _, _, g, w, r = coefs
    return rows_layout([w, g, r, retained(r, Tp)], docs, Tp, R)


def retained(r, Tp):
    """p_t = Π r_m over the tile's tokens m before t [B, T, H] (1 at a tile's first token): the
    first guess's d_t = clip(p_t d_0) follows the retention, which moves a_t by ~10 % a tile
    at r ~ 0.998 where the updates u_t s_t move it by ~1e-4 (one sweep fewer a tile)."""
    B, T, H = r.shape
    x = jnp.pad(r, [(0, 0), (0, Tp - T), (0, 0)], constant_values=1.0)
    x = x.reshape(B, Tp // TILE, TILE, H)
    x = jnp.concatenate([jnp.ones_like(x[:, :, :1]), jnp.cumprod(x[:, :, :-1], axis=2)], axis=2)
    return x.reshape(B, Tp, H)[:, :T]


def backward_rows(coefs, u, a, eps, Tp, docs=None):
    """The backward's [B, H, 4 (+ 3), Tp] from ``coefs`` (as ``coefficient_rows``'s) and the
    forward's u_t, a_t [B, T, H]: u, r, w g, [n̄ > ε] (1 − g a) w / n̄, padded with zeros but
    r = 1 (a padded token passes λ on unchanged); ``docs`` as ``coefficient_rows``'s."""
    _, n, g, w, r = coefs
    return rows_layout([u, r, w * g, jnp.where(n > eps, (1.0 - g * a) * w / n, 0.0)], docs, Tp,
                       RB)


def _check_rows(coefs, rows, packed):
    """ValueError unless ``coefs`` has the kernel's rows (``coefficient_rows`` /
    ``backward_rows``, with ``packed`` documents' three)."""
    if coefs.ndim != 4 or coefs.shape[2] != len(rows):
        raise ValueError(f"coefs must be [B, H, {len(rows)}, Tp] (packed={packed}), got "
                         f"{coefs.shape}")


def _clip(p, d_min, d_max):
    """``reference.osgm.clip_box``'s values (d_min <= d_max) as a max and a min: on the sweeps'
    chain, two min / max instructions instead of two compare-select pairs."""
    return jnp.minimum(jnp.maximum(p, d_min), d_max)


def _affine(r_t, d, u_t, s_t):
    """r_t d + u_t s_t (s_t = k_t ⊙ k_t): the argument of token t's clip (r_t None: r ≡ 1,
    no retention, one multiplication fewer on the sweeps' chain)."""
    return _retained(r_t, d) + u_t * s_t


def _retained(r_t, x):
    """r_t x (r_t None: x, r ≡ 1)."""
    return x if r_t is None else r_t * x


def _at(rows, t):
    """rows[t], or None where ``rows`` is None (r ≡ 1: no retention rows read)."""
    return None if rows is None else rows[t]


def _row_of(rows):
    """``rows`` read whole in the ROWS layout, or None where ``rows`` is None."""
    return None if rows is None else plgpu.load(rows, layout=ROWS)


def _changed(new, old):
    """Whether two ROWS vectors differ anywhere (a scalar)."""
    return jnp.sum(jnp.where(new != old, 1.0, 0.0)) > 0.0


def _accepts(s, wg, r, scale=None):
    """The test that ends a tile's Picard sweeps before the coupling comes back bit for bit:
    ``accept(x_new, x)`` for x_new = F(x), F the sweep and its row sums, true where the tile
    the sweep with x emitted (D, or M in reverse) is within a quarter float32 spacing of the
    fixed point's. Each token's map is 1-Lipschitz in d (|r_t| <= 1, the clip) and moves with
    its coupling x_t by |w_t g_t| s_tj, so ‖ΔD‖∞ <= ω ‖Δx‖∞ with ω = max_j Σ_t |w_t g_t| s_tj,
    and F contracts by κ <= ω max_t Σ_j s_tj; hence ‖x − x*‖∞ <= ‖x_new − x‖∞ / (1 − κ) and
    the test ω ‖x_new − x‖∞ <= 2⁻²⁶ ``scale`` (1 − κ). ``scale``: the largest |d| the box
    allows; None (the adjoint): max_t |x_new_t| / max_t Σ_j s_tj, a lower bound of max |M|.
    s [TILE, 128] (WGMMA layout), wg = w g and r [TILE] (ROWS; None: r ≡ 1). Never true where
    |r_t| > 1 or κ >= 1: such a tile settles bit for bit."""
    omega = jnp.max(jnp.sum(bcast_rows(jnp.abs(wg), s.shape) * s, axis=0))
    n_max = jnp.max(jnp.sum(s, axis=1))
    kappa = omega * n_max
    valid = kappa < 1.0 if r is None else (jnp.max(jnp.abs(r)) <= 1.0) & (kappa < 1.0)

    def accept(x_new, x):
        error = omega * jnp.max(jnp.abs(x_new - x))
        if scale is None:  # error n_max <= 2^-26 max|x_new| (1 - κ), without a division
            return valid & (error * n_max <= SPACING * jnp.max(jnp.abs(x_new)) * (1.0 - kappa))
        return valid & (error <= SPACING * scale * (1.0 - kappa))

    return accept


def _go_on(x_new, x, accept):
    """Whether a tile's sweeps go on after one took x to x_new: while x moves, and (``accept``
    not None) until ``accept(x_new, x)`` (``_accepts``)."""
    moving = _changed(x_new, x)
    return moving if accept is None else moving & jnp.logical_not(accept(x_new, x))


def _settle(step, x0, carry0, accept):
    """Picard sweeps ``x, carry = step(x)`` from the guess x0 until ``_go_on`` says stop (x back
    bit for bit, or ``accept``; None: bit for bit only), at most TILE + 1 (causality settles
    one more token a sweep). Returns (x, carry): the row sums of the tile the last sweep
    emitted, and what it returned."""
    def cond(c):
        return c[2] & (c[3] <= TILE)

    def body(c):
        x, _, _, n = c
        x_new, carry = step(x)
        return x_new, carry, _go_on(x_new, x, accept), n + 1

    x, carry, _, _ = lax.while_loop(cond, body, (x0, carry0, jnp.bool_(True), jnp.int32(0)))
    return x, carry


def _forward_sweep(d0, s_row, u, r, D, bounds, interpret, first=None):
    """d_t of the tile's tokens into the rows of ``D`` (a document's first token: the restart
    row already there) for the per-token u_t, r_t (shared-memory rows; ``r`` None: r ≡ 1) and
    s_t = ``s_row(t)``; returns the state after the tile."""
    def load(t):
        restart = None if first is None else (flag_mask(first[t]), row(D.at[t]))
        return _at(r, t), u[t], s_row(t), restart

    def step(t, values, d):
        r_t, u_t, s_t, restart = values
        if restart is not None:
            d = jnp.where(restart[0], restart[1], d)
        D.at[t][...] = d
        return _clip(_affine(r_t, d, u_t, s_t), *bounds)

    return tokens(load, step, d0, interpret)


def osgm_fwd(k, coefs, initial_state, *, bounds, interpret, packed=False, residuals=False,
             warpgroups=1, bound_stop=False, retention=True):
    """k [B, Tp, H, 128] (Tp a multiple of TILE), coefs [B, H, 4 (+ 3 if ``packed``), Tp]
    (``coefficient_rows``), initial_state [N, H, 128] float32 (N = B, or the documents);
    bounds (d_min, d_max). Returns k̃ [B, Tp, H, 128] in k's dtype and the final d [N, H, 128]
    float32; with ``residuals`` also the rows (u_t, a_t) [B, H, 2, Tp] and the state entering
    each tile [B, Tp / TILE, H, 128] float32 (``osgm_bwd``'s inputs). ``warpgroups`` 2 (16-bit
    keys): the sweeps' warpgroup does only the chain (the guess, the sweeps, the row sums) while
    a second one forms S of the next tile and k̃ of the last (``rows_mosaic.walk_pair``; two S
    and D tiles). ``bound_stop``: a tile's sweeps end at ``_accepts``' bound too (True), or
    only when the coupling comes back bit for bit (False, as ``osgm_precond.Options``).
    ``retention`` False: r ≡ 1 (vanilla OSDN), compiled in: the coefficient rows r and p are
    never read and the sweeps' chain loses its multiplication r_t d."""
    B, Tp, H, K = k.shape
    check_shape("osgm_mosaic.osgm_fwd", K, Tp)
    check_warpgroups(warpgroups, k)
    ins = (k, coefs, initial_state)
    out_type = (out_struct((B, Tp, H, K), k.dtype, *ins),
                out_struct(initial_state.shape, F32, *ins))
    if residuals:
        out_type += (out_struct((B, H, 2, Tp), F32, *ins),
                     out_struct((B, Tp // TILE, H, K), F32, *ins))
    vec = plgpu.SMEM((2, TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, TILE, K), k.dtype), w=vec, g=vec, r=vec, p=vec, u=vec, a=vec,
                   out=plgpu.SMEM((2, TILE, K), k.dtype), D=plgpu.SMEM((warpgroups, TILE, KP), F32),
                   S=plgpu.SMEM((warpgroups, TILE, KP), F32), starts=plgpu.SMEM((2, K), F32),
                   **doc_scratch(packed, vec))
    rows = range(7 if packed else 4)
    _check_rows(coefs, rows, packed)

    def body(k_ref, c_ref, init_ref, out_ref, final_ref, *res_refs, k, w, g, r, p, u, a, out, D,
             S, starts, state, start_bar, in_bar, doc_buf, stage, doc=None, first=None,
             last=None, ready=None, done=None):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = (w, g, r, p) + ((doc, first, last) if packed else ())

        def issue_tile(i, slot):
            issue((b, h), i, slot, in_bar, [(k_ref, k)], rows, c_ref, bufs)

        def form(i, slot):  # s_t = k_t ⊙ k_t of the tile's tokens into S
            with jax.named_scope("squares"):
                square_rows(k.at[slot], slot_tile(S, slot), interpret)

        def chain(i, slot, d0):
            D_, S_, u_t = slot_tile(D, slot), slot_tile(S, slot), u.at[slot]
            r_ = r.at[slot] if retention else None
            starts.at[slot][...] = d0
            if packed:
                restart_rows(init_ref, h, doc.at[slot], first.at[slot], D_, start_bar, stage)
            plgpu.commit_smem()
            with jax.named_scope("guess"):
                s = tile(S_, interpret)
                w_row = plgpu.load(w.at[slot], layout=ROWS)
                g_row = plgpu.load(g.at[slot], layout=ROWS)
                d_t = bcast_cols(plgpu.load(starts.at[slot], layout=COLS), s.shape)
                if retention:  # clip(p_t d_0)
                    d_t = bcast_rows(plgpu.load(p.at[slot], layout=ROWS), s.shape) * d_t
                guess = jnp.sum(s * _clip(d_t, *bounds), axis=1)

            def step(a_t):
                with jax.named_scope("sweep"):
                    u_t[...] = w_row * (1.0 - g_row * a_t)
                    plgpu.commit_smem()
                    d = _forward_sweep(d0, lambda t: row(S_.at[t]), u_t, r_, D_, bounds,
                                       interpret, first.at[slot] if packed else None)
                    plgpu.commit_smem()
                with jax.named_scope("row_sums"):
                    return row_sums(D_, s, interpret), d

            accept = _accepts(s, w_row * g_row, _row_of(r_),
                              max(abs(bounds[0]), abs(bounds[1]))) if bound_stop else None
            a_t, d = _settle(step, guess, d0, accept)
            a.at[slot][...] = a_t
            if packed:  # each document ending here: its state after its last token
                def ends(t, _):
                    value = _clip(_affine(_at(r_, t), row(D_.at[t]), u_t[t], row(S_.at[t])),
                                  *bounds)
                    document_out(value, final_ref, h, doc[slot, t].astype(jnp.int32),
                                 last[slot, t], doc_buf)
                lax.fori_loop(0, TILE, ends, None)
            return d

        def emit(i, slot):  # k̃_t = d_t ⊙ k_t, by rows (each thread its own D, k)
            D_, k_tile = slot_tile(D, slot), k.at[slot]

            def step(t, values, carry):
                out.at[slot, t][...] = (values[0] * values[1]).astype(k.dtype)
                return carry

            with jax.named_scope("emit"):
                tokens(lambda t: (row(D_.at[t]), row(k_tile.at[t])), step, None, interpret)

        def store_tile(i, slot):
            rows_ref, starts_ref = res_refs if residuals else (None, None)
            send((b, h), i, [(out.at[slot], out_ref)], rows_ref,
                 (u.at[slot], a.at[slot]) if residuals else (),
                 [(starts.at[slot], starts_ref)] if residuals else ())

        walk_tiles(warpgroups, Tp // TILE, False, issue_tile, in_bar, (ready, done), start_bar,
                   state, init_ref.at[0 if packed else b, h],
                   None if packed else final_ref.at[b, h], form, chain, emit, store_tile)

    return cta_kernel(body, "osgm_fwd_mosaic", out_type, scratch, B, H, interpret, ins,
                      len(rows) + 1, warpgroups)


def osgm_bwd(k, dkw, coefs, starts, init, dfinal, *, bounds, interpret, packed=False,
             warpgroups=1, bound_stop=False, retention=True):
    """The reverse scan by Picard sweeps per tile (tiles in reverse): with λ = ∂L/∂d_{t+1},
    μ = λ ⊙ [d_min < r d + u s < d_max], γ = ⟨μ, s⟩ (the sweeps' coupling),

        ∂k_t = 2 k (u μ − γ (w g) d − γ c_n) + ∂k̃ ⊙ d      ∂r_t = ⟨μ, d⟩
        λ ← r μ − γ (w g) s + ∂k̃ ⊙ k

    (with ``packed`` documents λ = dfinal[doc] at a document's last token, and ∂d_1[doc] the λ
    after its first), each tile's d_t recomputed by one forward sweep from ``starts`` [B, Tp /
    TILE, H, 128] and the rows' u_t. k and ∂k̃ [B, Tp, H, 128], coefs [B, H, 4 (+ 3), Tp]
    (``backward_rows``), init (the documents' initial states; read
    with ``packed`` only) and dfinal [N, H, 128]. Padded tokens (k = 0, r = 1) mask λ by [d_min
    < d < d_max] for the final d, as the last real token's clip derivative does already. Returns
    (∂k [B, Tp, H, 128] float32, rows (γ, ∂r) [B, H, 2, Tp] float32, ∂d_1 [N, H, 128]).
    ``warpgroups`` 2 (16-bit k and ∂k̃): the chain's warpgroup runs only the reverse sweeps
    while a second one recomputes d_t for the tile walked next and forms ∂r and ∂k of the tile
    walked before and sends them (``rows_mosaic.walk_pair``; two D and M tiles, s_t squared
    where read); ∂k then comes in k's dtype (the float32 values rounded once; ∂k̃ in the same
    dtype), written over ∂k̃'s tile and sent as one copy. ``bound_stop``, ``retention``: as
    ``osgm_fwd``'s (without retention ∂r is 0, not formed). Each tile's sweeps start from γ = 0."""
    B, Tp, H, K = k.shape
    check_shape("osgm_mosaic.osgm_bwd", K, Tp)
    check_warpgroups(warpgroups, k, dkw)
    d_min, d_max = bounds
    ins = (k, dkw, coefs, starts, init, dfinal)
    # ∂k in k's dtype in place of ∂k̃ (a dense tile: one copy), else float32 in M, by rows
    staged = warpgroups == 2 and dkw.dtype == k.dtype
    out_type = (out_struct((B, Tp, H, K), k.dtype if staged else F32, *ins),
                out_struct((B, H, 2, Tp), F32, *ins), out_struct(dfinal.shape, F32, *ins))
    vec = plgpu.SMEM((2, TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, TILE, K), k.dtype), dkw=plgpu.SMEM((2, TILE, K), dkw.dtype),
                   st=plgpu.SMEM((2, K), F32), u=vec, r=vec, gw=vec, gn=vec,
                   c=plgpu.SMEM((TILE,), F32), gam=vec, dr=vec,
                   D=plgpu.SMEM((warpgroups, TILE, KP), F32),
                   M=plgpu.SMEM((warpgroups, TILE, KP), F32), **doc_scratch(packed, vec))
    # s_t kept in S on one warpgroup with 16-bit keys; else no room: squared where read
    squares = k.dtype != F32 and warpgroups == 1
    if squares:
        scratch["S"] = plgpu.SMEM((TILE, KP), F32)
    if packed and warpgroups == 2:  # the second warpgroup's own restart rows
        scratch.update(form_bar=plgpu.Barrier(), form_stage=plgpu.SMEM((K,), F32))
    rows = range(4 + 3 * packed)
    _check_rows(coefs, rows, packed)

    def body(k_ref, dkw_ref, c_ref, st_ref, init_ref, dfinal_ref, dk_ref, rows_ref, dinit_ref,
             *, k, dkw, st, u, r, gw, gn, c, gam, dr, D, M, state, start_bar, in_bar,
             doc_buf, stage, S=None, doc=None, first=None, last=None, ready=None, done=None,
             form_bar=None, form_stage=None):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = (u, r, gw, gn) + ((doc, first, last) if packed else ())
        S = padded(S) if squares else None
        D_of, M_of = (functools.partial(slot_tile, x) for x in (D, M))

        def s_row(t, slot, k_t=None):
            """s_t = k_t ⊙ k_t (float32); ``k_t``: its row if already read."""
            if squares:
                return row(S.at[t])
            k_t = row(k.at[slot, t]) if k_t is None else k_t
            return k_t * k_t

        def s_tile(slot):
            """s of the tile in the WGMMA layout."""
            if squares:
                return tile(S, interpret)
            k_tile = tile(k.at[slot], interpret)
            return k_tile * k_tile

        def issue_tile(i, slot):
            issue((b, h), i, slot, in_bar, [(k_ref, k), (dkw_ref, dkw)], rows, c_ref, bufs,
                   [(st_ref, st)])

        def r_of(slot):
            """The slot's r row, None without retention (r ≡ 1)."""
            return r.at[slot] if retention else None

        def inside(t, slot, s_t):
            """[d_min < r_t d_t + u_t s_t < d_max]: where the clip passes λ at token t."""
            p = _affine(_at(r_of(slot), t), row(D_of(slot).at[t]), u[slot, t], s_t)
            return (p > d_min) & (p < d_max)

        def source(t, slot, k_t, s_t):
            """c_t s_t + ∂k̃_t ⊙ k_t: the adjoint's step at token t less its r_t μ_t."""
            return c[t] * s_t + row(dkw.at[slot, t]) * k_t

        def key(t, slot):
            """(k_t, s_t) of token t, k's row read once (its 16-bit loads held the sweeps'
            loop, RESULTS run 178)."""
            k_t = row(k.at[slot, t])
            return k_t, s_row(t, slot, k_t)

        def reverse_sweep(lam, slot):
            """μ_t into the rows of M (a document's last token: λ from the row there, whose μ
            is written once before the sweeps); λ ← r_t μ_t + ``source``; returns λ before the
            tile."""
            M = M_of(slot)

            def load(t):
                restart = (flag_mask(last[slot, t]), row(M.at[t])) if packed else None
                k_t, s_t = key(t, slot)
                return inside(t, slot, s_t), _at(r_of(slot), t), source(t, slot, k_t, s_t), restart

            def step(t, values, lam):
                keep, r_t, e_t, restart = values
                mu = jnp.where(keep, lam, 0.0)
                if restart is not None:
                    mu = jnp.where(restart[0], restart[1], mu)
                M.at[t][...] = mu
                return _retained(r_t, mu) + e_t

            return tokens(load, step, lam, interpret, reverse=True)

        def gradient_rows(slot):
            """∂k_t = 2 k_t ⊙ (u_t μ_t − γ_t w_t g_t d_t − γ_t c_n) + ∂k̃_t ⊙ d_t in place of
            μ_t in M, or (``staged``) rounded to k's dtype in place of ∂k̃_t, by rows (the
            coefficient rows and γ from shared memory)."""
            D, M = D_of(slot), M_of(slot)
            out = dkw.at[slot] if staged else M

            def load(t):
                return (row(k.at[slot, t]), row(dkw.at[slot, t]), row(M.at[t]), row(D.at[t]),
                        u[slot, t], -gam[slot, t], gw[slot, t], gn[slot, t])

            def step(t, values, carry):
                k_t, dkw_t, mu, d, u_t, neg_gam, gw_t, gn_t = values
                ds = u_t * mu + (neg_gam * gw_t) * d + neg_gam * gn_t
                out.at[t][...] = (2.0 * k_t * ds + dkw_t * d).astype(out.dtype)
                return carry

            tokens(load, step, None, interpret)

        def form(i, slot):  # the tile's d_t into D, by one forward sweep
            D = D_of(slot)
            with jax.named_scope("squares"):
                if squares:
                    square_rows(k.at[slot], S, interpret)
                if packed:
                    bar, buf = (start_bar, stage) if warpgroups == 1 else (form_bar, form_stage)
                    restart_rows(init_ref, h, doc.at[slot], first.at[slot], D, bar, buf)
            with jax.named_scope("recompute"):
                _forward_sweep(plgpu.load(st.at[slot], layout=VEC), lambda t: s_row(t, slot),
                               u.at[slot], r_of(slot), D, bounds, interpret,
                               first.at[slot] if packed else None)

        def chain(i, slot, lam0):
            M = M_of(slot)
            if warpgroups == 1:  # M's ∂k of the last tile was sent (the others wait for this
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # thread at the barrier
                # before M is written; with two, M's copies are the other warpgroup's)
            if packed:  # μ at each document's last token, from its dfinal row
                restart_rows(dfinal_ref, h, doc.at[slot], last.at[slot], M, start_bar, stage)

                def masked(t, _):
                    keep = flag_mask(last[slot, t]) & inside(t, slot, s_row(t, slot))
                    M.at[t][...] = jnp.where(keep, row(M.at[t]), 0.0)
                lax.fori_loop(0, TILE, masked, None)
            plgpu.commit_smem()
            s = s_tile(slot)
            gw_row = plgpu.load(gw.at[slot], layout=ROWS)

            def step(gam_t):
                with jax.named_scope("sweep"):
                    c[...] = -gam_t * gw_row
                    plgpu.commit_smem()
                    lam = reverse_sweep(lam0, slot)
                    plgpu.commit_smem()
                with jax.named_scope("row_sums"):
                    return row_sums(M, s, interpret), lam

            accept = _accepts(s, gw_row, _row_of(r_of(slot))) if bound_stop else None
            gam_t, lam = _settle(step, plgpu.layout_cast(jnp.zeros((TILE,), F32), ROWS), lam0,
                                 accept)
            gam.at[slot][...] = gam_t
            if packed:  # each document starting here: the λ before its first token
                def starts_(t, _):
                    lam_t = _retained(_at(r_of(slot), t), row(M.at[t])) + source(t, slot, *key(t, slot))
                    document_out(lam_t, dinit_ref, h, doc[slot, t].astype(jnp.int32),
                                 first[slot, t], doc_buf)
                lax.fori_loop(0, TILE, starts_, None)
            return lam

        def gradients(i, slot):  # ∂r_t = ⟨μ_t, d_t⟩, then ∂k_t in place of μ_t
            plgpu.commit_smem()  # γ in shared memory for every thread
            with jax.named_scope("dr"):
                if retention:
                    dr.at[slot][...] = jnp.sum(tile(M_of(slot), interpret)
                                               * tile(D_of(slot), interpret), axis=1)
                else:
                    dr.at[slot][...] = plgpu.layout_cast(jnp.zeros((TILE,), F32), ROWS)
            with jax.named_scope("gradients"):
                gradient_rows(slot)

        def store_tile(i, slot):
            send((b, h), i, [(dkw.at[slot], dk_ref)] if staged else [], rows_ref,
                 (gam.at[slot], dr.at[slot]), by_rows=[] if staged else [(M_of(slot), dk_ref)])

        walk_tiles(warpgroups, Tp // TILE, True, issue_tile, in_bar, (ready, done), start_bar,
                   state, dfinal_ref.at[0 if packed else b, h],
                   None if packed else dinit_ref.at[b, h], form, chain, gradients, store_tile)

    return cta_kernel(body, "osgm_bwd_mosaic", out_type, scratch, B, H, interpret, ins, len(rows) + 3,
                      warpgroups)

