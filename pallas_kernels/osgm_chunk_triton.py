"""The OSGM / OSDN d scan (SPEC 3.1) by chunks of C tokens, Pallas Triton lowering, fwd and reverse.

One program per (batch row, head) walks its row chunk by chunk with d [K] float32 in registers.
Per chunk (d_i the state before its token i = 0..C-1, d_0 the chunk start, notation of
``osgm_triton``, c = w g, ρ_i = Π_{m<i} r_m, E_ij = ρ_i / ρ_{j+1} for j < i, 0 otherwise):
coordinates of d_0 exactly on a bound are assumed pinned for the whole chunk, the others free
(s' = s ⊙ free, y_i = ρ_i d_0 on free coordinates and d_0 on pinned ones); then the clipped
recurrence is the affine map of ``chunked.osgm``:

    (I + L) u = w − c ⊙ ⟨s_i, y_i⟩      L_ij = c_i E_ij ⟨s'_i, s'_j⟩    (unit lower-triangular)
    d_i = y_i + Σ_{j<i} E_ij u_j s'_j    p_i = r_i d_i + u_i s_i        d_C = free ? p_{C-1} : d_0

with u by the doubling product of (I + L)^-1 and the d_i by one [C, C] x [C, K] dot. The kernel
then checks the hypothesis on every token and coordinate (free: d_min < p < d_max; pinned high:
p ≥ d_max; pinned low: p ≤ d_min; and c ‖s‖² ≤ 1 + r, no step can expand); where it fails the
same chunk is redone by the exact token loop of ``osgm_triton`` (a ``lax.cond`` in the kernel).

Reverse, λ = ∂L/∂d. On a fast chunk the clip's derivative is the free mask, so ℓ_i = free ⊙ λ_i
follows the transposed map: ℓ_i = r_i ℓ_{i+1} − c_i γ_i s'_i + e_i with γ_i = ⟨ℓ_{i+1}, s'_i⟩ and
e_i = free ⊙ ∂k̃_i ⊙ k_i, solved as

    (I + L)ᵀ γ = ρ_C/ρ_{i+1} ⟨ℓ_C, s'_i⟩ + Σ_{j>i} E_ji ⟨e_j, s'_i⟩
    ℓ_{i+1} = ρ_C/ρ_{i+1} ℓ_C + Σ_{j>i} E_ji (e_j − c_j γ_j s'_j)       (μ_i = ℓ_{i+1})

after which every token's cotangents are those of ``osgm_triton.token_backward`` with μ_i and
γ_u = γ_i, and ∂L/∂d_0 = r_0 μ_0 − c_0 γ_0 s_0 + ∂k̃_0 ⊙ k_0. A fallback chunk runs the reverse
token loop on the d_t that the forward's residual mode wrote for that chunk only; the forward
also stores d at every chunk start and whether each chunk was fast.

Layout: the document-aligned chunk layout of ``precond_linattn.varlen`` flattened to [B, NC·C,
H, ·] (padding slots: k = 0, β = 0, r = 1 leave d unchanged); per-chunk flags ``doc``, ``first``,
``last`` [B, NC] int32. Dense rows (``packed`` False) see their own state row as document 0.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.osgm_triton import (
    AUX, BETA, coefficients, token_backward, token_forward, token_loop)
from pallas_kernels.triton_common import Dots, iota2

_TINY = float(np.finfo(np.float32).tiny)  # r = 0 keeps a finite log


def _powers(L, dots):
    """[L, L², L⁴, …, L^(C/2)] of a strictly lower-triangular C x C tile (L^C = 0)."""
    powers = [L]
    while 2 ** len(powers) < L.shape[0]:
        powers.append(dots.nn(powers[-1], powers[-1]))
    return powers


def _unit_lower_solve(powers, b, transpose):
    """(I + L)^-1 b, or (I + L)^-T b if ``transpose``, for b [C], by the doubling product
    (I + L)^-1 = (I − L)(I + L²)(I + L⁴)…(I + L^(C/2)) applied factor by factor to the vector
    (matrix-vector products: log2(C) − 1 matmuls in all, for the powers, against 2 log2(C) − 2
    for ``triton_common.unit_lower_inverse``)."""
    def apply(P, x, sign):  # x + sign P x, or x + sign Pᵀ x
        return x + sign * (jnp.sum(P * x[:, None], axis=0) if transpose else
                           jnp.sum(P * x[None, :], axis=1))

    factors = [(powers[0], -1.0)] + [(P, 1.0) for P in powers[1:]]  # applied right to left
    for P, sign in (factors if transpose else factors[::-1]):
        b = apply(P, b, sign)
    return b


def _row(x, i):
    """Row i of a loaded tile [C, K] as [K]."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, 0) == i, x, 0.0), axis=0)


class _Solution(NamedTuple):
    s: jax.Array      # [C, K] k ⊙ k
    ss: jax.Array     # [C] Σ s
    n: jax.Array      # [C] n̄
    g: jax.Array      # [C]
    w: jax.Array      # [C] η g / n̄
    r: jax.Array      # [C]
    c: jax.Array      # [C] w g (0 where a step could expand)
    E: jax.Array      # [C, C] ρ_i / ρ_{j+1}, j < i
    e_end: jax.Array  # [C] ρ_C / ρ_{j+1}
    free: jax.Array   # [K] bool
    sf: jax.Array     # [C, K] s'
    powers: list      # [L, L², …, L^(C/2)], each [C, C]
    u: jax.Array      # [C]
    d: jax.Array      # [C, K] d_i
    end: jax.Array    # [K] d_C
    ok: jax.Array     # the hypothesis holds


def _solve(d0, k, aux, *, hyper, beta_aware, dots):
    """The chunk under the active-set hypothesis (module docstring) from d_0 [K], k [C, K] float32
    and aux [C, AUX]."""
    eta, d_min, d_max, eps = hyper
    i, j = iota2(k.shape[0])
    s, ss, n, g, w, r = coefficients(k, aux, eta, eps, beta_aware)
    stable = w * g * jnp.sum(s * s, axis=1) <= 1.0 + r
    c = jnp.where(stable, w * g, 0.0)
    log_r = jnp.log(jnp.maximum(r, _TINY))
    before = jnp.sum(jnp.where(j < i, log_r[None, :], 0.0), axis=1)  # log ρ_i
    upto = before + log_r  # log ρ_{i+1}
    E = jnp.exp(jnp.where(i > j, before[:, None] - upto[None, :], -jnp.inf))
    e_end = jnp.exp(jnp.sum(log_r) - upto)
    hi = d0 == d_max
    lo = (d0 == d_min) & ~hi
    free = ~(hi | lo)
    sf = jnp.where(free[None, :], s, 0.0)
    y = jnp.where(free[None, :], jnp.exp(before)[:, None] * d0[None, :], d0[None, :])
    powers = _powers(c[:, None] * E * dots.nt(sf, sf), dots)
    u = _unit_lower_solve(powers, w - c * jnp.sum(s * y, axis=1), False)
    d = y + dots.nn(E * u[None, :], sf)
    p = r[:, None] * d + u[:, None] * s
    inside = (p > d_min) & (p < d_max)
    holds = jnp.where(hi[None, :], p >= d_max, jnp.where(lo[None, :], p <= d_min, inside))
    fails = jnp.sum(jnp.where(holds, 0, 1)) + jnp.sum(jnp.where(stable, 0, 1))
    end = jnp.where(free, _row(p, k.shape[0] - 1), d0)
    return _Solution(s, ss, n, g, w, r, c, E, e_end, free, sf, powers, u, d, end, fails == 0)


def _chunk_backward(lam, k, dkw, sol, *, hyper, beta_aware, dots):
    """(∂L/∂k [C, K], (∂L/∂β, ∂L/∂r) [C, AUX], ∂L/∂d_0 [K]) of a fast chunk from λ = ∂L/∂d_C
    (the transposed solve of the module docstring)."""
    eta, eps = hyper[0], hyper[3]
    l_end = jnp.where(sol.free, lam, 0.0)
    e = jnp.where(sol.free[None, :], dkw * k, 0.0)
    rhs = (sol.e_end * jnp.sum(sol.sf * l_end[None, :], axis=1)
           + jnp.sum(sol.E * dots.nt(e, sol.sf), axis=0))
    gam = _unit_lower_solve(sol.powers, rhs, True)
    mu = sol.e_end[:, None] * l_end[None, :] + dots.tn(sol.E, e - (sol.c * gam)[:, None] * sol.sf)
    a = jnp.sum(sol.d * sol.s, axis=1)
    v = 1.0 - sol.g * a
    ga = -sol.c * gam
    gn = jnp.where(sol.ss > eps, -gam * v * sol.w / sol.n, 0.0)
    dk = 2.0 * k * (sol.u[:, None] * mu + ga[:, None] * sol.d + gn[:, None]) + dkw * sol.d
    dbeta = (-gam * sol.w * a + gam * v * eta / sol.n) if beta_aware else jnp.zeros_like(a)
    col = lax.broadcasted_iota(jnp.int32, (k.shape[0], AUX), 1)
    daux = jnp.where(col == BETA, dbeta[:, None], jnp.sum(mu * sol.d, axis=1)[:, None])
    lam0 = _row(sol.r[:, None] * mu + ga[:, None] * sol.s + dkw * k, 0)
    return dk, daux, lam0


def _fwd_kernel(doc_ref, first_ref, last_ref, k_ref, aux_ref, init_ref, kw_ref, final_ref,
                fast_ref, *res_refs, hyper, beta_aware, dots, chunk, prefetch):
    """One (row, head): per chunk d_0 (initial[doc] at a document's first chunk), the active-set
    solution or, where it fails, the token loop; k̃_t = d_t ⊙ k_t; final[doc] = d_C after a
    document's last chunk. ``res_refs``: (d_0 per chunk, d_t of fallback chunks) if wanted."""
    f32 = jnp.float32
    step = functools.partial(token_forward, hyper=hyper, beta_aware=beta_aware)

    def body(c, d):
        t0 = pl.multiple_of(c * chunk, chunk)
        rows = pl.ds(t0, chunk)
        doc = doc_ref[c]
        d = jnp.where(first_ref[c] != 0, init_ref[doc], d)
        k = k_ref[rows, :].astype(f32)
        sol = _solve(d, k, aux_ref[rows, :], hyper=hyper, beta_aware=beta_aware, dots=dots)
        fast_ref[c] = sol.ok.astype(jnp.int32)
        if res_refs:
            res_refs[0][c] = d

        def fast():
            kw_ref[rows, :] = (sol.d * k).astype(kw_ref.dtype)
            return sol.end

        def token(t, row, d):
            kw_ref[t] = (d * row[0]).astype(kw_ref.dtype)
            if res_refs:
                res_refs[1][t] = d
            return step(d, *row)

        def exact():
            return token_loop(t0, chunk, False, prefetch,
                              lambda t: (k_ref[t].astype(f32), aux_ref[t]), token, d)

        d = lax.cond(sol.ok, fast, exact)

        @pl.when(last_ref[c] != 0)
        def _():
            final_ref[doc] = d

        return d

    lax.fori_loop(0, doc_ref.shape[0], body, jnp.zeros(k_ref.shape[-1:], f32))


def _bwd_kernel(doc_ref, first_ref, last_ref, fast_ref, k_ref, aux_ref, dstart_ref, dtok_ref,
                dkw_ref, dfinal_ref, dk_ref, daux_ref, dinit_ref, *, hyper, beta_aware, dots,
                chunk, prefetch):
    """One (row, head), chunks in reverse: λ = dfinal[doc] after a document's last chunk, the
    transposed solve on fast chunks or the reverse token loop on d_t, dinit[doc] = ∂L/∂d_0 at a
    document's first chunk."""
    f32 = jnp.float32
    nc = doc_ref.shape[0]
    step = functools.partial(token_backward, hyper=hyper, beta_aware=beta_aware)

    def body(i, lam):
        c = nc - 1 - i
        t0 = pl.multiple_of(c * chunk, chunk)
        rows = pl.ds(t0, chunk)
        doc = doc_ref[c]
        lam = jnp.where(last_ref[c] != 0, dfinal_ref[doc], lam)

        def fast():
            k = k_ref[rows, :].astype(f32)
            sol = _solve(dstart_ref[c], k, aux_ref[rows, :], hyper=hyper, beta_aware=beta_aware,
                         dots=dots)
            dk, daux, lam0 = _chunk_backward(lam, k, dkw_ref[rows, :].astype(f32), sol,
                                             hyper=hyper, beta_aware=beta_aware, dots=dots)
            dk_ref[rows, :] = dk
            daux_ref[rows, :] = daux
            return lam0

        def loads(t):
            return (k_ref[t].astype(f32), aux_ref[t], dtok_ref[t], dkw_ref[t].astype(f32))

        def token(t, row, lam):
            k, aux, d, dkw = row
            dk, daux, lam = step(lam, d, k, aux, dkw)
            dk_ref[t] = dk
            daux_ref[t] = daux
            return lam

        lam = lax.cond(fast_ref[c] != 0, fast,
                       lambda: token_loop(t0, chunk, True, prefetch, loads, token, lam))

        @pl.when(first_ref[c] != 0)
        def _():
            dinit_ref[doc] = lam

        return lam

    lax.fori_loop(0, nc, body, jnp.zeros(k_ref.shape[-1:], f32))


def _specs(Tp, K, nc, num_docs, packed):
    """BlockSpecs: token rows [Tp, K] and [Tp, AUX], chunk flags [NC], per-chunk values [NC] and
    [NC, K], document states (all documents packed, else the row's own)."""
    state = (pl.BlockSpec((num_docs, None, K), lambda b, h: (0, h, 0)) if packed else
             pl.BlockSpec((1, None, K), lambda b, h: (b, h, 0)))
    return dict(k=pl.BlockSpec((None, Tp, None, K), lambda b, h: (b, 0, h, 0)),
                aux=pl.BlockSpec((None, Tp, None, AUX), lambda b, h: (b, 0, h, 0)),
                flags=pl.BlockSpec((None, nc), lambda b, h: (b, 0)),
                chunks=pl.BlockSpec((None, None, nc), lambda b, h: (b, h, 0)),
                chunk_k=pl.BlockSpec((None, None, nc, K), lambda b, h: (b, h, 0, 0)), state=state)


def _call(kernel, name, args, in_specs, outs, k, num_docs, *, packed, chunk, num_warps, dots,
          **static):
    """``pallas_call`` over the (batch row, head) grid of keys ``k``; ``in_specs``: a spec name
    per argument; ``outs``: (spec name, shape, dtype) per result."""
    B, Tp, H, K = k.shape
    sp = _specs(Tp, K, Tp // chunk, num_docs, packed)
    return pl.pallas_call(
        functools.partial(kernel, dots=dots, chunk=chunk, **static), grid=(B, H),
        in_specs=[sp[n] for n in in_specs], out_specs=[sp[o[0]] for o in outs],
        out_shape=[jax.ShapeDtypeStruct(o[1], o[2]) for o in outs],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=dots.interpret, name=name,
    )(*args)


def osgm_chunk_fwd(doc, first, last, k, aux, initial_state, *, hyper, beta_aware, packed, chunk,
                   residual, dots: Dots, prefetch, num_warps):
    """k [B, Tp, H, K] (chunk layout); aux [B, Tp, H, AUX] float32; initial_state [N, H, K]
    float32 (N = B unless ``packed``); doc, first, last [B, NC] int32.

    Returns k̃ (k's dtype), final d [N, H, K], fast [B, H, NC] int32 (1: the chunk took the
    active-set path) and, if ``residual``, d at every chunk start [B, H, NC, K] and d_t [B, Tp,
    H, K] (float32; written on fallback chunks only)."""
    B, Tp, H, K = k.shape
    nc = Tp // chunk
    outs = [("k", k.shape, k.dtype), ("state", initial_state.shape, jnp.float32),
            ("chunks", (B, H, nc), jnp.int32)]
    if residual:
        outs += [("chunk_k", (B, H, nc, K), jnp.float32), ("k", k.shape, jnp.float32)]
    return _call(_fwd_kernel, "osgm_fwd", [doc, first, last, k, aux, initial_state],
                 ["flags"] * 3 + ["k", "aux", "state"], outs, k, initial_state.shape[0],
                 packed=packed, chunk=chunk,
                 num_warps=num_warps, dots=dots, hyper=hyper, beta_aware=beta_aware,
                 prefetch=prefetch)


def osgm_chunk_bwd(doc, first, last, fast, k, aux, dstart, dtok, dkw, dfinal, *, hyper,
                   beta_aware, packed, chunk, dots: Dots, prefetch, num_warps):
    """Cotangents (dk [B, Tp, H, K], daux [B, Tp, H, AUX] (β and r), dinit [N, H, K]), all
    float32, from the residuals of ``osgm_chunk_fwd`` (fast, dstart, dtok), dk̃ and dfinal."""
    outs = [("k", k.shape, jnp.float32), ("aux", aux.shape, jnp.float32),
            ("state", dfinal.shape, jnp.float32)]
    args = [doc, first, last, fast, k, aux, dstart, dtok, dkw, dfinal]
    specs = ["flags"] * 3 + ["chunks", "k", "aux", "chunk_k", "k", "k", "state"]
    return _call(_bwd_kernel, "osgm_bwd", args, specs, outs, k, dfinal.shape[0], packed=packed,
                 chunk=chunk, num_warps=num_warps, dots=dots, hyper=hyper, beta_aware=beta_aware,
                 prefetch=prefetch)
