"""One chunk of the delta core (SPEC 2.1) with a write key, forward and pullback, in the
recompute form of jax-linear-attention's GDN kernels: the specification the rung-2 kernels
(benchmarks/NOTES.md, "how jax-linear-attention's GDN / DeltaNet kernels are built") implement,
in plain JAX, and their test oracle. No decay or a scalar one; one chunk, no batch axes (vmap
it).

Forward of a chunk (rows i, j = 0 .. C−1; g the log decays, G = cumsum g, Γ = exp G, Γ_C = exp
G_{C−1}, D_ij = exp(G_i − G_j) for i >= j else 0; S the chunk-start state [K, V]):

    A0 = strict_tril(Diag(β) K K̃ᵀ)    T0 = (I + A0)^-1          (gate-free: stored in bf16 there)
    T  = T0 ⊙ D                        (the decay is a diagonal similarity: T = (I + A0 ⊙ D)^-1)
    X  = V − Diag(Γ) K S               R = T Diag(β) X            (R = U − W S of SPEC 2.1)
    P  = tril(Q K̃ᵀ) ⊙ D               O = scale (Diag(Γ) Q S + P R)
    S' = Γ_C S + (Diag(Γ_C/Γ) K̃)ᵀ R

Pullback from dO and dS' (the cotangent of S'), everything recomputed from the inputs, S and
T0 (no W, U, K̃', Q' or P kept from the forward):

    dR = scale Pᵀ dO + Diag(Γ_C/Γ) K̃ dS'     dX = Diag(β) Tᵀ dR = dV
    dS = Γ_C dS' + scale (Diag(Γ) Q)ᵀ dO − (Diag(Γ) K)ᵀ dX          (the state pass's chain)
    dT = dR (Diag(β) X)ᵀ    dA0 = −T0ᵀ (dT ⊙ D) T0ᵀ on the strict lower triangle
    dP = scale tril(dO Rᵀ)
    dQ = scale Diag(Γ) dO Sᵀ + (dP ⊙ D) K̃
    dK = −Diag(Γ) dX Sᵀ + Diag(β) dA0 K̃
    dK̃ = Diag(Γ_C/Γ) R dS'ᵀ + dA0ᵀ Diag(β) K + (dP ⊙ D)ᵀ Q
    dβ = rowsum(dA0 ⊙ K K̃ᵀ) + rowsum(Tᵀ dR ⊙ X)
    dG_i = rowsum(E)_i − colsum(E)_i + scale Γ_i ⟨dO_i, (Q S)_i⟩ − Γ_i ⟨dX_i, (K S)_i⟩
           − (Γ_C/Γ_i) ⟨k̃_i, dS' r_i⟩ + δ_{i,C−1} (Σ_j (Γ_C/Γ_j) ⟨k̃_j, dS' r_j⟩ + Γ_C ⟨dS', S⟩),
    E = (dT ⊙ T + dP ⊙ P) off the diagonal,   dg_t = Σ_{i>=t} dG_i.

Over a sequence: the states S come from the chunk-start states of a forward pass (recomputed),
and the backward carries dS from the last chunk to the first; every chunk's gradients are then
independent (one CTA a chunk there). The decay's factors here are the plain exps of the
differences (the kernels' exactness with strong decays is their own matter, NOTES v8.6).
"""

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST)


def _decays(g, C):
    """(G, Γ, Γ_C, D) of a chunk's log decays g [C] (None: no decay)."""
    G = jnp.zeros((C,), jnp.float32) if g is None else jnp.cumsum(g)
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    D = jnp.where(i >= j, jnp.exp(jnp.where(i >= j, G[:, None] - G[None, :], 0.0)), 0.0)
    return G, jnp.exp(G), jnp.exp(G[-1]), D


def _inverse(A0):
    """(I + A0)^-1 for strictly lower-triangular A0."""
    C = A0.shape[0]
    return jax.scipy.linalg.solve_triangular(jnp.eye(C) + A0, jnp.eye(C), lower=True,
                                             unit_diagonal=True)


def _recompute(q, k, kw, v, beta, g, S):
    """A chunk's forward terms: (G, Γ, Γ_C, D, K K̃ᵀ, T0, T, K S, X, R, P)."""
    C = k.shape[0]
    G, Gam, Gam_C, D = _decays(g, C)
    gram = _dot(k, kw.T)
    T0 = _inverse(jnp.tril(beta[:, None] * gram, -1))
    T = T0 * D
    KS = _dot(k, S)
    X = v - Gam[:, None] * KS
    R = _dot(T, beta[:, None] * X)
    return G, Gam, Gam_C, D, gram, T0, T, KS, X, R, jnp.tril(_dot(q, kw.T)) * D


def _dR(P, kw, Gam, Gam_C, do, dS_end, scale):
    """dR = scale Pᵀ dO + Diag(Γ_C/Γ) K̃ dS'."""
    return scale * _dot(P.T, do) + _dot((Gam_C / Gam)[:, None] * kw, dS_end)


def chunk_forward(q, k, kw, v, beta, g, S, scale):
    """(O [C, V], S' [K, V]) of one chunk (module docstring); g None: no decay."""
    _, Gam, Gam_C, _, _, _, _, _, _, R, P = _recompute(q, k, kw, v, beta, g, S)
    O = scale * (Gam[:, None] * _dot(q, S) + _dot(P, R))
    return O, Gam_C * S + _dot(((Gam_C / Gam)[:, None] * kw).T, R)


def backward_inputs(q, k, kw, v, beta, g, S, do, dS_end, scale):
    """(T [C, C], R [C, V], dR [C, V]): what the WY forward (T) and the two state passes (R, dR)
    hand the split backward's per-chunk kernels (``grads_mosaic``)."""
    _, Gam, Gam_C, _, _, _, T, _, _, R, P = _recompute(q, k, kw, v, beta, g, S)
    return T, R, _dR(P, kw, Gam, Gam_C, do, dS_end, scale)


def chunk_pullback(q, k, kw, v, beta, g, S, do, dS_end, scale):
    """The cotangents (dq, dk, dkw, dv, dbeta, dg (None without a decay), dS) of one chunk from
    dO and dS' (module docstring)."""
    _, Gam, Gam_C, D, gram, T0, T, KS, X, R, P = _recompute(q, k, kw, v, beta, g, S)
    tail = Gam_C / Gam  # Γ_C/Γ
    QS = _dot(q, S)
    dR = _dR(P, kw, Gam, Gam_C, do, dS_end, scale)
    TdR = _dot(T.T, dR)
    dX = beta[:, None] * TdR
    dS = Gam_C * dS_end + scale * _dot((Gam[:, None] * q).T, do) - _dot((Gam[:, None] * k).T, dX)
    dT = _dot(dR, (beta[:, None] * X).T)
    dA0 = jnp.tril(-_dot(_dot(T0.T, dT * D), T0.T), -1)
    dP = scale * jnp.tril(_dot(do, R.T))
    GQ = dP * D
    RdS = _dot(R, dS_end.T)  # r_i dS'ᵀ rows: ⟨k̃_i, dS' r_i⟩ = rowsum(RdS ⊙ K̃)
    dq = scale * Gam[:, None] * _dot(do, S.T) + _dot(GQ, kw)
    dk = -Gam[:, None] * _dot(dX, S.T) + beta[:, None] * _dot(dA0, kw)
    dkw = tail[:, None] * RdS + _dot(dA0.T, beta[:, None] * k) + _dot(GQ.T, q)
    dbeta = jnp.sum(dA0 * gram, axis=1) + jnp.sum(TdR * X, axis=1)
    dg = None
    if g is not None:
        off = 1.0 - jnp.eye(D.shape[0])
        E = (dT * T + dP * P) * off
        w = tail * jnp.sum(RdS * kw, axis=1)  # (Γ_C/Γ_i) ⟨k̃_i, dS' r_i⟩
        dG = (jnp.sum(E, axis=1) - jnp.sum(E, axis=0) + scale * Gam * jnp.sum(do * QS, axis=1)
              - Gam * jnp.sum(dX * KS, axis=1) - w)
        dG = dG.at[-1].add(jnp.sum(w) + Gam_C * jnp.sum(dS_end * S))
        dg = jnp.cumsum(dG[::-1])[::-1]
    return dq, dk, dkw, dX, dbeta, dg, dS
