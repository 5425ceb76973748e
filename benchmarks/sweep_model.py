"""A float32 NumPy model of ``osgm_mosaic``'s Picard sweeps: how many a tile each first guess
needs, forward and backward, on ``bench_osgm``'s inputs (issue 4: the sweeps are the phase's
chain). It runs the kernels' algorithm tile by tile (64 tokens, sweeps until the coupling comes
back bit for bit) with exchangeable first guesses; the kernels' own guesses reproduce the
device's counts (APF: forward 2.14 / backward 3.10 a tile here, 2.21 / 3.08 in run 165's probe).

    PYTHONPATH=. python benchmarks/sweep_model.py [--T 2048] [--heads 4] [--vanilla]

Forward, per tile with entering state d⁰ (p_t = Π_{m<t} r_m within the tile):

    retained (the kernels'):  a_t = ⟨clip(p_t d⁰), s_t⟩
    first_order:              a_t += Σ_{τ<t} (p_t / p_{τ+1}) ⟨s_τ ⊙ f_t, s_t⟩ w_τ (1 − g_τ a_τ),
                              f_t = [d_min < p_t d⁰ < d_max] (coordinates the clip leaves free)

Backward (adjoint coupling γ_t = ⟨μ_t, s_t⟩, masks m_t = [d_min < r_t d_t + u_t s_t < d_max]
known from the recomputed d_t):

    zero (the kernels'):      γ = 0
    uncoupled:                γ of the reverse scan with c = 0 (the sources ∂k̃ ⊙ k and λ⁰ through
                              the masks): the first sweep's result, were it computed off the chain
    first_order:              uncoupled, then γ_t += Σ_{τ>t} ρ_t / (ρ_τ r_τ) ⟨s_t ⊙ m_t, s_τ⟩ c_τ,
                              c = −γ w g, ρ_t = Π_{σ>t} r_σ

``--gram bf16`` rounds the Gram products' operands to bf16 (tensor-core inputs).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_osgm import make_inputs
from precond_linattn.chunked.osgm_picard import coefficients

TILE = 64
F32 = np.float32


def rounded(x, gram):
    """``x`` as the Gram products' operand: float32, or rounded to bf16."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16), F32) if gram == "bf16" else x


def settle(sweep, x, accept=None):
    """Sweeps ``x_new, out = sweep(x)`` until x comes back bit for bit, or ``accept(x_new,
    x)`` (at most TILE + 1); returns (out, sweeps run)."""
    for n in range(1, TILE + 2):
        x_new, out = sweep(x)
        if np.array_equal(x_new, x) or (accept is not None and accept(x_new, x)):
            break
        x = x_new
    return out, n


def accepts(S, WG, R, scale, bound):
    """``osgm_mosaic._accepts``' contraction bound (with ``bound``; else None): the sweep that
    took x to x_new emitted within a quarter float32 spacing of the fixed point's values.
    ``scale``: the box's largest |d| (forward), None: the adjoint's max |x_new| / n_max."""
    if not bound:
        return None
    omega = np.max(np.sum(np.abs(WG)[:, None] * S, axis=0))
    n_max = np.max(np.sum(S, axis=1))
    kappa = omega * n_max
    valid = np.max(np.abs(R)) <= 1.0 and kappa < 1.0

    def accept(x_new, x):
        error = omega * np.max(np.abs(x_new - x))
        if scale is None:
            return valid and error * n_max <= 2.0 ** -26 * np.max(np.abs(x_new)) * (1 - kappa)
        return valid and error <= 2.0 ** -26 * scale * (1 - kappa)

    return accept


def forward_tile(d0, S, W, G, R, bounds, guess, gram, bound=False):
    """One tile's sweeps: (D [TILE, K] the d_t, d after the tile, u [TILE], sweeps)."""
    lo, hi = bounds
    p = np.concatenate([[1.0], np.cumprod(R[:-1])]).astype(F32)
    a = (S * np.clip(p[:, None] * d0, lo, hi)).sum(1).astype(F32)
    if guess == "first_order":
        free = (p[:, None] * d0 > lo) & (p[:, None] * d0 < hi)
        p_next = (p * R).astype(F32)
        L = np.tril((rounded(S * free, gram) @ rounded(S, gram).T) * (p[:, None] / p_next), -1)
        a = (a + L @ (W * (1 - G * a))).astype(F32)

    def sweep(a):
        u = (W * (1 - G * a)).astype(F32)
        D, d = np.empty_like(S), d0
        for t in range(TILE):
            D[t] = d
            d = np.clip(R[t] * d + u[t] * S[t], lo, hi).astype(F32)
        return (D * S).sum(1).astype(F32), (D, d, u)

    (D, d, u), n = settle(sweep, a, accepts(S, W * G, R, max(map(abs, bounds)), bound))
    return D, d, u, n


def backward_tile(lam0, S, W, G, R, E, D, u, bounds, guess, gram, bound=False):
    """One tile's reverse sweeps from λ⁰ (∂L/∂d after the tile), sources E = ∂k̃ ⊙ k:
    (λ before the tile, sweeps)."""
    lo, hi = bounds
    P = R[:, None] * D + u[:, None] * S
    keep = (P > lo) & (P < hi)

    def scan(gam, lam):
        c = (-gam * W * G).astype(F32)
        M = np.empty_like(S)
        for t in reversed(range(TILE)):
            M[t] = np.where(keep[t], lam, 0.0)
            lam = (R[t] * M[t] + (c[t] * S[t] + E[t])).astype(F32)
        return (M * S).sum(1).astype(F32), lam

    gam = np.zeros(TILE, F32)
    if guess == "tile":
        gam = tile_guess(lam0, S, W, G, R, E, keep, gram)
    elif guess != "zero":
        gam = scan(gam, lam0)[0]
        if guess == "first_order":
            rho = np.concatenate([np.cumprod(R[::-1])[::-1][1:], [1.0]]).astype(F32)
            U = np.triu((rounded(S * keep, gram) @ rounded(S, gram).T)
                        * (rho[:, None] / (rho * R)[None, :]), 1)
            gam = (gam + U @ (-gam * W * G)).astype(F32)
    lam, n = settle(lambda g: scan(g, lam0), gam, accepts(S, W * G, R, None, bound))
    return lam, n


def split(x, gram):
    """x as a sum of bf16 hi and lo parts (``gram`` "bf16"), or itself."""
    if gram != "bf16":
        return x
    hi = rounded(x, gram)
    return hi + rounded(x - hi, gram)


def tile_guess(lam0, S, W, G, R, E, keep, gram):
    """The backward's guess by tile products only: with z_j the tile's last token whose mask
    is 0 and ρ_t = Π_{σ>t} r_σ, the uncoupled coupling where no mask cuts between t and the
    tile's end, 0 elsewhere, γ⁰_t = ρ_t Σ_j s_tj [z_j < t] (λ⁰_j + (U E')_tj) (U the strictly
    upper ones, E' = E / (ρ r) split into bf16 hi and lo parts), then its first-order
    coupling γ_t = γ⁰_t + ρ_t Σ_j s_tj [z_j < t] (U diag(c / (ρ r)) S)_tj, c = −γ⁰ w g."""
    rho = np.concatenate([np.cumprod(R[::-1])[::-1][1:], [1.0]]).astype(F32)
    t = np.arange(TILE)
    z = np.max(np.where(keep, -1, t[:, None]), axis=0)
    reach = t[:, None] > z[None, :]
    U = np.triu(np.ones((TILE, TILE), F32), 1)
    scale = (1.0 / (rho * R))[:, None]
    C1 = U @ split(E * scale, gram)
    gam = (rho * (S * reach * (lam0[None, :] + C1)).sum(1)).astype(F32)
    C2 = U @ rounded((-gam * W * G)[:, None] * scale * S, gram)
    return (gam + rho * (S * reach * C2).sum(1)).astype(F32)


def sweeps(x, dkw, *, apf, forward_guess, backward_guess, gram="f32", eta=0.003,
           bounds=(0.5, 2.0), bound=False):
    """Sweeps a tile, forward and backward, of every tile and head of row 0, and the final d
    of each head: ([n], [n], [H, K]); the backward from λ = 0.1 after the last token (masked by
    the final d's box), with ∂k̃ ``dkw``; ``bound``: stopped at the contraction bound too."""
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    s, _, g, w, r = (np.asarray(c, F32) for c in coefficients(
        f(x["k"]), f(x["beta"]), f(x["r"]) if apf else None, eta, True, 1e-6))
    k, dkw = np.asarray(f(x["k"])), np.asarray(f(dkw))
    T, H = s.shape[1], s.shape[2]
    fwd, bwd, finals = [], [], []
    for h in range(H):
        tiles = [slice(i, i + TILE) for i in range(0, T, TILE)]
        d, saved = np.asarray(x["d0"][0, h], F32), []
        for sl in tiles:
            D, d_next, u, n = forward_tile(d, s[0, sl, h], w[0, sl, h], g[0, sl, h],
                                           r[0, sl, h], bounds, forward_guess, gram, bound)
            saved.append((D, u))
            fwd.append(n)
            d = d_next
        finals.append(d)
        lam = np.where((d > bounds[0]) & (d < bounds[1]), 0.1, 0.0).astype(F32)
        for sl, (D, u) in reversed(list(zip(tiles, saved))):
            lam, n = backward_tile(lam, s[0, sl, h], w[0, sl, h], g[0, sl, h], r[0, sl, h],
                                   dkw[0, sl, h] * k[0, sl, h], D, u, bounds, backward_guess, gram,
                                   bound)
            bwd.append(n)
    return fwd, bwd, np.stack(finals)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=2048, help="tokens (a multiple of 64)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vanilla", action="store_true", help="OSDN without APF retention")
    ap.add_argument("--gram", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--bound", action="store_true", help="stop at the contraction bound too "
                    "(the kernels' bound_stop)")
    a = ap.parse_args()
    if a.T % TILE:
        ap.error(f"--T must be a multiple of {TILE}, got {a.T}")
    x, key = make_inputs(jax.random.PRNGKey(0), 1, a.T, a.heads, 128, jnp.bfloat16)
    dkw = jax.random.normal(key, x["k"].shape, jnp.bfloat16)
    print(f"{'OSDN' if a.vanilla else 'OSDN-APF'}, 1x{a.T}x{a.heads}x128 bf16 inputs, Gram "
          f"operands {a.gram}, {'bound' if a.bound else 'bitwise'} stop: mean sweeps a tile "
          f"(distribution)")
    for fg, bg in (("retained", "zero"), ("retained", "uncoupled"),
                   ("first_order", "first_order"), ("first_order", "tile")):
        fwd, bwd, _ = sweeps(x, dkw, apf=not a.vanilla, forward_guess=fg, backward_guess=bg,
                             gram=a.gram, bound=a.bound)
        print(f"  forward {fg:12s} {np.mean(fwd):5.2f} {np.bincount(fwd)[1:].tolist()}   "
              f"backward {bg:12s} {np.mean(bwd):5.2f} {np.bincount(bwd)[1:].tolist()}",
              flush=True)


if __name__ == "__main__":
    main()
