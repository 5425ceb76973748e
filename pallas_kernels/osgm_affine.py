"""Blocks of U tokens of the OSGM d scan (SPEC 3.1) solved as one affine map, inside the
token-loop kernels of ``osgm_triton`` (``Options.affine_block``).

Where the clip's pattern is fixed over a block, the scan is affine in d (SPEC 3.1's note): a
set of free coordinates (mask m) moves without touching the box, the others stay on a bound,
no document starts or ends in the block and r >= 0. With tokens j = 0 .. U−1 of the block, d_0
the entering state, s̄_j = m ⊙ s_j the free part of s_j, and the d-independent

    s_j = k_j ⊙ k_j    w_j = η g_j / n̄_j    G_ji = ⟨s̄_j, s̄_i⟩    Π_j = ∏_{m<j} r_m
    Q_ji = ∏_{i<m<j} r_m  (i < j)        N_ji = w_j g_j Q_ji G_ji  (i < j, else 0)

the steps u_j = w_j (1 − g_j ⟨d_j, s_j⟩) solve
(I + N) u = w ⊙ (1 − g ⊙ (Π ⊙ S̄ d_0 + S ((1 − m) ⊙ d_0))), and

    d_j = Π_j m ⊙ d_0 + Σ_{i<j} Q_ji u_i s̄_i + (1 − m) ⊙ d_0,    d_U the same with j = U.

So the serial chain of a block is the mask, a U x U inverse ((I + N)^-1 by
``unit_lower_inverse``: the Gram depends on m) and three reductions, instead of U dependent
⟨d, s⟩ reductions; the rows d_j (the block's outputs) and the test are off that chain. The
forward takes m from d_0 (free: strictly inside the box) and accepts the block if every free
pre-clip value r_j d_j + u_j s_j stays strictly inside and every other coordinate sits on a
bound that each token's pre-clip value reaches or passes (the clip keeps it there).

The reverse scan of ``osgm_triton._bwd`` (λ_j = ∂L/∂d_j, e_j = ∂k̃_j ⊙ k_j, μ_j = m ⊙ λ_{j+1},
γ_j = ⟨μ_j, s_j⟩, λ_j = r_j μ_j − w_j g_j γ_j s_j + e_j) is affine the same way where its clip
mask m (from the forward's d_j, which it reads) is the same for every token of the block: the
free part ν_j = m ⊙ λ_j follows it with s̄ and m ⊙ e, so

    (I + N)ᵀ γ = Π' ⊙ S̄ (m ⊙ λ_U) + z,   z_j = Σ_{i>j} Q_ij ⟨e_i, s̄_j⟩,   Π'_j = ∏_{j<m<U} r_m,
    μ_j = ν_{j+1} = Π'_j m ⊙ λ_U + Σ_{i>j} Q_ij (m ⊙ e_i − w_i g_i γ_i s̄_i),
    λ_0 = ν_0 + (1 − m) ⊙ (e_0 − w_0 g_0 γ_0 s_0).

The products of r come from exp of differences of the in-block cumsum of log r (log r clamped at
−80: a factor below e^-80 and exactly 0 are the same to float32 next to the other terms, and the
clamp keeps the differences finite). Blocks that fail their test run token by token (the callers'
exact path), so the results equal the token loop's to float32 rounding (closer to a float64 scan
than the token loop's own: its rounding compounds token by token). U x U and U x K products
are 2-D dots (U >= 16) at about float32 (``Dots``' "tf32x3"); the U-long sums are
broadcast-reduces.
"""

import jax.numpy as jnp
from jax import lax

from pallas_kernels.triton_common import Dots, iota2, unit_lower_inverse

LOG_R_MIN = -80.0


def columns(auxb, *which):
    """The columns ``which`` of a block's aux rows [U, AUX], each [U]."""
    col = lax.broadcasted_iota(jnp.int32, auxb.shape, 1)
    return [jnp.sum(jnp.where(col == c, auxb, 0.0), axis=1) for c in which]


def row(x, j):
    """Row j of x [U, K] (loaded values cannot be indexed)."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, 0) == j, x, 0.0), axis=0)


def all_true(x):
    """Whether every element of the boolean x holds."""
    return jnp.sum(jnp.where(x, 0, 1)) == 0


def coefficients(kb, beta, r, eta, eps, beta_aware):
    """The block's terms that depend neither on d nor on the mask (module docstring): s [U, K],
    Σ s, n̄, g, w [U]; for the products of r, incl_j = Σ_{m<=j} log r_m, excl_j = incl_j − log
    r_j [U], total = incl_{U−1}; Q [U, U] (Q_ji for i < j, else 0)."""
    s = kb * kb
    ss = jnp.sum(s, axis=1)
    n = jnp.maximum(ss, eps)
    g = beta if beta_aware else jnp.ones_like(ss)
    w = eta * g / n
    lr = jnp.maximum(jnp.log(jnp.maximum(r, 0.0)), LOG_R_MIN)
    incl = jnp.cumsum(lr)
    excl = incl - lr
    j, i = iota2(s.shape[0])
    Q = jnp.where(i < j, jnp.exp(excl[:, None] - incl[None, :]), 0.0)
    return s, ss, n, g, w, incl, excl, jnp.sum(lr), Q


def _inverse(co, free, dots: Dots):
    """(s̄ = m ⊙ s [U, K], (I + N)^-1 [U, U]) for the mask ``free`` [K] (0 / 1 floats)."""
    s, _, _, g, w, _, _, _, Q = co
    sf = s * free[None, :]
    return sf, unit_lower_inverse((w * g)[:, None] * Q * dots.nt(sf, sf), dots)


def forward(d0, co, r, valid, d_min, d_max, dots: Dots):
    """(rows d_j [U, K], d_U [K], whether the block is solved) from d_0 and ``coefficients``
    ``co``; ``valid`` [K] bool: the coordinates that are not padding (the only ones tested)."""
    s, _, _, g, w, incl, excl, total, Q = co
    free = jnp.where((d0 > d_min) & (d0 < d_max), 1.0, 0.0)
    sf, inv = _inverse(co, free, dots)
    moving, fixed = free * d0, (1.0 - free) * d0
    c = jnp.exp(excl) * jnp.sum(sf * d0[None, :], axis=1) + jnp.sum(s * fixed[None, :], axis=1)
    u = jnp.sum(inv * (w * (1.0 - g * c))[None, :], axis=1)
    d_end = (jnp.exp(total) * moving + fixed
             + jnp.sum((jnp.exp(total - incl) * u)[:, None] * sf, axis=0))
    rows = jnp.exp(excl)[:, None] * moving[None, :] + fixed[None, :] + dots.nn(Q * u[None, :], sf)
    p = r[:, None] * rows + u[:, None] * s  # = d_{j+1} before its clip
    held = (((d0 == d_min)[None, :] & (p <= d_min)) | ((d0 == d_max)[None, :] & (p >= d_max)))
    ok = jnp.where(free[None, :] > 0, (p > d_min) & (p < d_max), held) | ~valid[None, :]
    return rows, d_end, all_true(ok)


def backward(lam, co, e, free, dots: Dots):
    """(rows μ_j = m ⊙ λ_{j+1} [U, K], γ [U], λ_0 [K]) of a block whose clip mask is ``free``
    [K] (0 / 1 floats) at every token, from λ_U = ``lam``, ``coefficients`` ``co`` and
    e = ∂k̃ ⊙ k [U, K] (module docstring)."""
    s, _, _, g, w, incl, excl, total, Q = co
    sf, inv = _inverse(co, free, dots)
    lam_f = free * lam
    later = jnp.exp(total - incl)  # Π'_j
    z = later * jnp.sum(sf * lam_f[None, :], axis=1) + jnp.sum(Q * dots.nt(e, sf), axis=0)
    gamma = jnp.sum(inv * z[:, None], axis=0)
    terms = free[None, :] * e - (w * g * gamma)[:, None] * sf
    mu = later[:, None] * lam_f[None, :] + dots.tn(Q, terms)
    nu0 = jnp.exp(total) * lam_f + jnp.sum(jnp.exp(excl)[:, None] * terms, axis=0)
    first = row(e - (w * g * gamma)[:, None] * s, 0)  # e_0 − w_0 g_0 γ_0 s_0
    return mu, gamma, nu0 + (1.0 - free) * first
