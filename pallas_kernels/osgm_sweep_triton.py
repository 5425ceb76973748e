"""One Picard sweep of the OSGM d scan (``precond_linattn.chunked.osgm_picard``) and of its
adjoint as Pallas Triton-lowered kernels: the d recurrence for a GIVEN coupling, so no reduction
is on the per-token chain.

One program per (row, head, block of ``block_k`` coordinates) walks the tokens in order, with
u_t = w_t (1 − g_t a_t) from the LAST sweep's coupling a_t (an input):

    d_t = initial[doc] at a document's first token (packed), else the carried d
    a_ref[t] = Σ_{block} d_t ⊙ s_t            (s_t = k_t ⊙ k_t; the block's share of ⟨d_t, s_t⟩)
    d ← clip(r_t d_t + u_t s_t, d_min, d_max)   (one FMA and the clip: the whole chain)

With ``emit`` it also writes k̃_t = d_t ⊙ k_t (or d_t itself with ``emit_d``) and the final d (per
document if ``packed``), as ``osgm_triton.osgm_fwd`` does. The reverse sweep (``osgm_sweep_bwd``)
is the adjoint's, for c_t = −w_t g_t γ_t from the last sweep's γ_t (tokens in reverse; Λ the
cotangent of d after token t, m_t the clip's free mask at the forward's d_t):

    Λ = dfinal[doc] at a document's last token, else the carried D
    μ_t = m_t ⊙ Λ;  γ_ref[t] = Σ_{block} μ_t ⊙ s_t
    D = r_t μ_t + c_t s_t + ∂k̃_t ⊙ k_t        (∂L/∂d_t; dinit[doc] = D at its first token)

and with ``emit`` writes ∂k_t = 2 k_t ⊙ (u_t μ_t + c_t d_t + γ_n) + ∂k̃_t ⊙ d_t (γ_n = −γ_t u_t
/ n̄_t) and the block shares of ∂r_t = ⟨μ_t, d_t⟩ (∂β_t, a per-token scalar, is XLA's).

Over sequence pieces (``osgm_precond``, ``token_pieces``: row b p + i is piece i of sequence b)
each sweep first composes each piece's maps (``osgm_sweep_compose``: x ↦ clip(α x + b, lo, hi),
the forward's maps compose into one of the same form; ``osgm_sweep_compose_bwd``: Λ ↦ M ⊙ Λ + E
for the adjoint); the sweep's program for piece i then chains its entering state from its
sequence's initial state through the maps of the pieces before it (``_entering``, p − 1 steps on
[block_k] vectors), so a sweep is two kernels and no XLA in between.

The per-token scalars travel in ``osgm_triton``'s aux rows: w_t and g_t in columns W and G, r_t
in RET, a reverse sweep's u_t (the forward's) in U_BWD, the document columns as there; the token
loop (groups of ``unroll`` tokens, rows ``prefetch`` groups ahead) is ``osgm_triton``'s.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.osgm_triton import (
    DOC, FIRST, LAST, RET, _at_boundary, _load_aux, _scalars, _store_at, _token_loop)
from pallas_kernels.triton_common import out_struct
from precond_linattn.reference.osgm import clip_box

U_BWD, W, G = 5, 6, 7  # aux columns: the forward's u_t (reverse sweeps), w_t and g_t
INV_N = 0  # an emitting reverse sweep's [n̄_t > ε] / n̄_t, in the β column (β enters as g_t)
BIG = 1e30  # the identity map's bounds (finite: r = 0 must not meet 0 · inf)


def _entering(start, maps, pieces, *, reverse=False):
    """The state entering this program's piece i (its row r = b p + i): from ``start`` (its
    sequence's initial state) through the maps of pieces 0..i−1, in order (``reverse``: the
    adjoint's, from pieces p−1..i+1 down), read from ``maps`` (refs [B p, bk], the compose
    kernels' outputs of every row): x ↦ clip(α x + b, lo, hi), or M ⊙ x + E (two maps)."""
    if pieces == 1:
        return start
    r = pl.program_id(0)
    i = r % pieces
    base = r - i
    order = range(pieces - 1, 0, -1) if reverse else range(pieces - 1)
    x = start
    for q in order:
        m = [ref[base + q] for ref in maps]
        y = m[0] * x + m[1] if len(m) == 2 else clip_box(m[0] * x + m[1], m[2], m[3])
        x = jnp.where(q > i if reverse else q < i, y, x)
    return x


def _kernel(k_ref, aux_ref, a_prev_ref, init_ref, *refs, bounds, packed, emit, emit_d,
            pieces, prefetch, unroll, scalar_aux):
    """The module docstring's sweep over this program's tokens and coordinates, u_t formed from
    the last sweep's coupling a_t."""
    d_min, d_max = bounds
    maps, (a_ref, *out) = (refs[:4], refs[4:]) if pieces > 1 else ((), refs)
    out_ref, final_ref = out if emit else (None, None)
    columns = (W, G, RET) + ((DOC, FIRST, LAST) if packed else ())

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                jnp.sum(a_prev_ref[:, t]))

    def group(t0, rows, d):
        scalars = [_scalars(aux, columns, scalar_aux) for _, aux, _ in rows]
        for i, ((k, _, a), sc) in enumerate(zip(rows, scalars)):
            if packed:
                doc, d = _at_boundary(sc, FIRST, init_ref, d)
            s = k * k
            a_ref[t0 + i] = jnp.sum(d * s)
            if emit:
                out_ref[t0 + i] = d if emit_d else (d * k).astype(out_ref.dtype)
            d = clip_box(sc[RET] * d + sc[W] * (1.0 - sc[G] * a) * s, d_min, d_max)
            if packed and emit:
                _store_at(sc, LAST, final_ref, doc, d)
        return d

    d0 = (jnp.ones(k_ref.shape[-1:], jnp.float32) if packed
          else _entering(init_ref[...], maps, pieces))
    d = _token_loop(k_ref.shape[0], False, unroll, prefetch, loads, group, d0)
    if emit and not packed:
        final_ref[...] = d


def _specs(k, aux, block_k, coupling_blocks=1):
    """Block specs over (row, head, block of ``block_k`` coordinates): a [B, T, H, K] sequence,
    the aux rows, a coupling as [B, H, J, T] block shares (J = ``coupling_blocks``; 1: the sum),
    a [B, H, K] state of the row, every row's [B, H, K] state (a piece's map, read by the pieces
    after it), and a [B, H, K / block_k, T] share."""
    B, T, H, K = k.shape
    bk = min(block_k, K)
    return dict(
        seq=pl.BlockSpec((None, T, None, bk), lambda b, h, j: (b, 0, h, j)),
        aux=pl.BlockSpec((None, T, None, aux.shape[-1]), lambda b, h, j: (b, 0, h, 0)),
        coupling=pl.BlockSpec((None, None, coupling_blocks, T), lambda b, h, j: (b, h, 0, 0)),
        state=pl.BlockSpec((None, None, bk), lambda b, h, j: (b, h, j)),
        every_row=pl.BlockSpec((B, None, bk), lambda b, h, j: (0, h, j)),
        shares=pl.BlockSpec((None, None, None, T), lambda b, h, j: (b, h, j, 0))), bk


def _sweep_specs(name, args, n_in, pieces, packed, block_k):
    """(``_specs``, the state spec, [the shares' out spec], [their struct]) of a sweep over
    ``args`` = (k, aux, ..., its [N, H, K] state (the ``n_in``-th), the pieces' maps); ValueError
    unless the maps come exactly with p > 1 over dense rows."""
    k, aux, maps = args[0], args[1], args[n_in:]
    if (pieces > 1) != bool(maps) or (packed and pieces > 1):
        raise ValueError(f"{name} takes the pieces' maps exactly when pieces > 1 (dense rows "
                         f"only), got pieces={pieces}, {len(maps)} maps, packed={packed}")
    R, L, H, K = k.shape
    spec, bk = _specs(k, aux, block_k, args[n_in - 2].shape[2])  # the coupling before the state
    N = args[n_in - 1].shape[0]
    states = pl.BlockSpec((N, None, bk), lambda b, h, j: (0, h, j)) if packed else spec["state"]
    return spec, states, [spec["shares"]], [out_struct((R, H, K // bk, L), jnp.float32, *args)]


def _pallas(kernel, name, grid, in_specs, out_specs, out_shape, args, num_warps, interpret):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(*args)


def osgm_sweep(k, aux, a_prev, initial_state, *maps, hyper, beta_aware, packed, pieces,
               emit, emit_d, block_k, prefetch, num_warps, unroll, scalar_aux, interpret):
    """k [R, L, H, K] (R = B p rows of L = T / p tokens: piece i of row b is row b p + i); aux
    [R, L, H, AUX] float32 (w_t and g_t in columns W, G; r_t in RET); a_prev [R, H, J, L]
    float32, the last sweep's coupling a_t = ⟨d_t, s_t⟩ as J block shares, summed here (J = 1:
    the coupling itself; u_t = w_t (1 − g_t a_t)); initial_state [N, H,
    K] float32: each row's sequence's initial state (N = R), or per document if ``packed`` (p =
    1); ``maps``: with p > 1 the four [R, H, K] maps (α, b, lo, hi) of ``osgm_sweep_compose``,
    through which each piece chains its entering state; hyper (η, d_min, d_max, ε): the bounds
    are used (η, ε and ``beta_aware`` are folded into w, g). Returns [the block shares of ⟨d_t,
    s_t⟩ [R, H, K / block_k, L] float32] and with ``emit`` also k̃ (k's dtype; every d_t float32
    if ``emit_d``) and each row's final d [N, H, K]."""
    del beta_aware
    args = (k, aux, a_prev, initial_state, *maps)
    spec, states, out_specs, out_shape = _sweep_specs("osgm_sweep", args, 4, pieces, packed,
                                                      block_k)
    if emit:
        out_specs += [spec["seq"], states]
        out_shape += [out_struct(k.shape, jnp.float32 if emit_d else k.dtype, *args),
                      out_struct(initial_state.shape, jnp.float32, *args)]
    kernel = functools.partial(_kernel, bounds=hyper[1:3], packed=packed, emit=emit,
                               emit_d=emit_d, pieces=pieces, prefetch=prefetch, unroll=unroll,
                               scalar_aux=scalar_aux)
    return _pallas(kernel, "osgm_sweep", out_shape[0].shape[:3],  # (row, head, block)
                   [spec["seq"], spec["aux"], spec["coupling"], states]
                   + [spec["every_row"]] * len(maps), out_specs, out_shape, args, num_warps,
                   interpret)


def _compose_kernel(k_ref, aux_ref, a_prev_ref, alpha_ref, b_ref, lo_ref, hi_ref, *, bounds,
                    prefetch, unroll, scalar_aux):
    """This program's tokens composed into the one map they apply (dense rows; ``osgm_sweep``'s
    update, u_t = w_t (1 − g_t a_t) from the last sweep's a_t): after them d is clip(α d_0 + b,
    lo, hi), from the identity (α, b, lo, hi) = (1, 0, −BIG, BIG) by, token by token,

        α ← r_t α    b ← r_t b + u_t s_t    lo ← clip(r_t lo + u_t s_t)    hi ← clip(r_t hi + u_t s_t)."""
    d_min, d_max = bounds
    columns = (W, G, RET)

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                jnp.sum(a_prev_ref[:, t]))

    def group(t0, rows, carry):
        del t0
        alpha, b, lo, hi = carry
        for k, aux, a in rows:
            sc = _scalars(aux, columns, scalar_aux)
            r, us = sc[RET], sc[W] * (1.0 - sc[G] * a) * (k * k)
            alpha, b, lo, hi = (r * alpha, r * b + us, clip_box(r * lo + us, d_min, d_max),
                                clip_box(r * hi + us, d_min, d_max))
        return alpha, b, lo, hi

    zero = jnp.zeros(k_ref.shape[-1:], jnp.float32)
    alpha_ref[...], b_ref[...], lo_ref[...], hi_ref[...] = _token_loop(
        k_ref.shape[0], False, unroll, prefetch, loads, group,
        (zero + 1.0, zero, zero - BIG, zero + BIG))


def _compose_call(name, kernel, args, in_kinds, n_maps, *, packed, block_k, num_warps,
                  interpret):
    """``kernel`` (its static arguments bound) over (row, head, block of ``block_k``
    coordinates) of ``args`` (k, aux, then sequences and couplings, ``_specs``' kinds named by
    ``in_kinds``): ``n_maps`` maps [R, H, K] float32; dense rows only (ValueError if
    ``packed``)."""
    if packed:
        raise ValueError(f"{name} takes dense rows (no cu_seqlens)")
    R, L, H, K = args[0].shape
    spec, bk = _specs(args[0], args[1], block_k, args[-1].shape[2])  # the coupling last
    return _pallas(kernel, name, (R, H, K // bk), [spec[x] for x in in_kinds],
                   [spec["state"]] * n_maps, [out_struct((R, H, K), jnp.float32, *args)] * n_maps,
                   args, num_warps, interpret)


def osgm_sweep_compose(k, aux, a_prev, *, hyper, beta_aware, packed, block_k, prefetch,
                       num_warps, unroll, scalar_aux, interpret):
    """Each row's forward-sweep map (``_compose_kernel``; dense rows only): (α, b, lo, hi) [R, H,
    K] float32 for k, aux and a_prev as ``osgm_sweep``'s."""
    del beta_aware
    kernel = functools.partial(_compose_kernel, bounds=hyper[1:3], prefetch=prefetch,
                               unroll=unroll, scalar_aux=scalar_aux)
    return _compose_call("osgm_sweep_compose", kernel, (k, aux, a_prev),
                         ("seq", "aux", "coupling"), 4, packed=packed, block_k=block_k,
                         num_warps=num_warps, interpret=interpret)


def _coupling_c(sc, gamma):
    """A reverse sweep's c_t = −w_t g_t γ_t from the last sweep's γ_t."""
    return -sc[W] * sc[G] * gamma


def _compose_bwd_kernel(k_ref, aux_ref, d_ref, dkw_ref, g_prev_ref, m_ref, e_ref, *, bounds,
                        prefetch, unroll, scalar_aux):
    """This program's tokens (in reverse) composed into the one affine map of ``osgm_sweep_bwd``
    (dense rows): the cotangent at the first token is M ⊙ Λ + E for Λ that after the last, from
    the identity (M, E) = (1, 0) by, token by token (m_t the clip's free mask),

        M ← r_t m_t M    E ← r_t m_t E + c_t s_t + ∂k̃_t ⊙ k_t."""
    d_min, d_max = bounds
    columns = (W, G, RET, U_BWD)

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                d_ref[t], dkw_ref[t].astype(jnp.float32), jnp.sum(g_prev_ref[:, t]))

    def group(t0, rows, carry):
        del t0
        M, E = carry
        for k, aux, d, dkw, gamma in reversed(rows):
            sc = _scalars(aux, columns, scalar_aux)
            s = k * k
            p = sc[RET] * d + sc[U_BWD] * s
            rm = jnp.where((p > d_min) & (p < d_max), sc[RET], 0.0)
            M, E = rm * M, rm * E + _coupling_c(sc, gamma) * s + dkw * k
        return M, E

    one = jnp.ones(k_ref.shape[-1:], jnp.float32)
    m_ref[...], e_ref[...] = _token_loop(k_ref.shape[0], True, unroll, prefetch, loads, group,
                                         (one, one - 1.0))


def osgm_sweep_compose_bwd(k, aux, d, dkw, g_prev, *, hyper, beta_aware, packed, block_k,
                           prefetch, num_warps, unroll, scalar_aux, interpret):
    """Each row's reverse-sweep map (``_compose_bwd_kernel``; dense rows only): (M, E) [R, H, K]
    float32 for k, aux, d, dkw, g_prev as ``osgm_sweep_bwd``'s."""
    del beta_aware
    kernel = functools.partial(_compose_bwd_kernel, bounds=hyper[1:3], prefetch=prefetch,
                               unroll=unroll, scalar_aux=scalar_aux)
    return _compose_call("osgm_sweep_compose_bwd", kernel, (k, aux, d, dkw, g_prev),
                         ("seq", "aux", "seq", "seq", "coupling"), 2, packed=packed,
                         block_k=block_k, num_warps=num_warps, interpret=interpret)


def _bwd_kernel(k_ref, aux_ref, d_ref, dkw_ref, g_prev_ref, dfinal_ref, *refs, bounds, packed,
                emit, pieces, prefetch, unroll, scalar_aux):
    """The module docstring's reverse sweep over this program's tokens and coordinates, c_t
    formed from the last sweep's γ_t."""
    d_min, d_max = bounds
    maps, (g_ref, *out) = (refs[:2], refs[2:]) if pieces > 1 else ((), refs)
    dk_ref, dr_ref, dinit_ref = out if emit else (None, None, None)
    columns = (W, G, RET, U_BWD) + ((INV_N,) if emit else ()) + (
        (DOC, FIRST, LAST) if packed else ())

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                d_ref[t], dkw_ref[t].astype(jnp.float32), jnp.sum(g_prev_ref[:, t]))

    def group(t0, rows, D):
        scalars = [_scalars(aux, columns, scalar_aux) for _, aux, _, _, _ in rows]
        for i in reversed(range(len(rows))):
            (k, _, d, dkw, gamma), sc = rows[i], scalars[i]
            s = k * k
            p = sc[RET] * d + sc[U_BWD] * s
            if packed:
                doc, D = _at_boundary(sc, LAST, dfinal_ref, D)
            mu = jnp.where((p > d_min) & (p < d_max), D, 0.0)
            g_ref[t0 + i] = jnp.sum(mu * s)
            c = _coupling_c(sc, gamma)
            if emit:  # ∂s = u μ + γ_a d + γ_n with γ_a = c and γ_n = −γ u / n̄
                ds = sc[U_BWD] * mu + c * d - gamma * sc[U_BWD] * sc[INV_N]
                dk_ref[t0 + i] = 2.0 * k * ds + dkw * d
                dr_ref[t0 + i] = jnp.sum(mu * d)
            D = sc[RET] * mu + c * s + dkw * k
            if packed and emit:
                _store_at(sc, FIRST, dinit_ref, doc, D)
        return D

    D0 = (jnp.zeros(k_ref.shape[-1:], jnp.float32) if packed
          else _entering(dfinal_ref[...], maps, pieces, reverse=True))
    D = _token_loop(k_ref.shape[0], True, unroll, prefetch, loads, group, D0)
    if emit and not packed:
        dinit_ref[...] = D


def osgm_sweep_bwd(k, aux, d, dkw, g_prev, dfinal, *maps, hyper, beta_aware, packed,
                   pieces, emit, block_k, prefetch, num_warps, unroll, scalar_aux, interpret):
    """k [R, L, H, K] (rows of pieces as ``osgm_sweep``'s); aux [R, L, H, AUX] float32 (w_t, g_t
    in W, G, r_t in RET, the forward's u_t in column U_BWD); d [R, L, H, K] float32 (the
    forward's d_t); dkw [R, L, H, K]; g_prev [R, H, J, L] float32, the last sweep's γ_t = ⟨μ_t,
    s_t⟩ as a_prev in ``osgm_sweep`` (c_t = −w_t g_t γ_t); dfinal [N, H, K] float32 (each
    row's sequence's, or per document if ``packed``); ``maps``: with p > 1 the two [R, H, K] maps (M, E) of
    ``osgm_sweep_compose_bwd``. Returns [the block shares of γ_t [R, H, K / block_k, L]
    float32] and with ``emit`` (aux then also holds [n̄ > ε] / n̄ in column INV_N) also ∂k_t
    [R, L, H, K] (``osgm_triton``'s formula, γ_t the last sweep's), the block shares of
    ∂r_t = ⟨μ_t, d_t⟩ and each row's dinit [N, H, K], float32."""
    del beta_aware
    args = (k, aux, d, dkw, g_prev, dfinal, *maps)
    spec, states, out_specs, out_shape = _sweep_specs("osgm_sweep_bwd", args, 6, pieces, packed,
                                                      block_k)
    if emit:
        out_specs += [spec["seq"], spec["shares"], states]
        out_shape += [out_struct(k.shape, jnp.float32, *args), out_shape[0],
                      out_struct(dfinal.shape, jnp.float32, *args)]
    kernel = functools.partial(_bwd_kernel, bounds=hyper[1:3], packed=packed, emit=emit,
                               pieces=pieces, prefetch=prefetch, unroll=unroll,
                               scalar_aux=scalar_aux)
    return _pallas(kernel, "osgm_sweep_bwd", out_shape[0].shape[:3],
                   [spec["seq"], spec["aux"], spec["seq"], spec["seq"], spec["coupling"], states]
                   + [spec["every_row"]] * len(maps), out_specs, out_shape, args, num_warps,
                   interpret)
