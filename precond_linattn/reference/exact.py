"""Exact (ridge-regression) preconditioning of SPEC 3.3 and its diagonal approximation.

Reference only, O(K²) state, one sequence: q, k [T, K], v [T, V], λ > 0 (vmap for batches).
Computed in the inputs' dtype at full precision: float32, or float64 under ``jax.enable_x64``.
With G_t = λI + Σ_{i≤t} k_i k_iᵀ, C_t = Σ_{i≤t} v_i k_iᵀ and P_t = G_t^-1 (P_0 = I/λ):

    ATQ:  o_t = C_t P_t q_t
    ATK:  k̃_t = P_{t−1} k_t / (1 + k_tᵀ P_{t−1} k_t)
          S_t = S_{t−1} + (v_t − S_{t−1} k_t) k̃_tᵀ      (V × K layout, S_0 = 0, no β)
          o_t = S_t q_t

P_t is kept by Sherman–Morrison, P_t = P_{t−1} − P_{t−1} k_t k_tᵀ P_{t−1} / (1 + k_tᵀ P_{t−1} k_t).
Theorem 3.1: S_t = C_t P_t, so both give the same outputs at every step. The diagonal versions
replace G_t by its diagonal, P_t = Diag(1 / (λ + Σ_{i≤t} k_i ⊙ k_i)), and the equality fails.
"""

import jax
import jax.numpy as jnp

from precond_linattn.numerics import HIGHEST


def _mv(M, x):
    """M x (or a dot product) at full precision in the inputs' dtype."""
    return jnp.dot(M, x, precision=HIGHEST)


def _sherman_morrison(P, k):
    """(P^-1 + k kᵀ)^-1 for symmetric P."""
    Pk = _mv(P, k)
    return P - jnp.outer(Pk, Pk) / (1.0 + _mv(k, Pk))


def _diagonal(P, k):
    """Diag(1 / (1 / diag(P) + k ⊙ k)): the inverse of the diagonal of P^-1 + k kᵀ."""
    return jnp.diag(1.0 / (1.0 / jnp.diag(P) + k * k))


def _scan(step, q, k, v, lam):
    """Outputs [T, V] of ``step`` over the tokens from the state (0 [V, K], I/λ)."""
    K, V = k.shape[-1], v.shape[-1]
    init = (jnp.zeros((V, K), k.dtype), jnp.eye(K, dtype=k.dtype) / lam)
    return jax.lax.scan(step, init, (q, k, v))[1]


def _atq(q, k, v, lam, update):
    def step(carry, x):
        C, P = carry
        q_t, k_t, v_t = x
        C = C + jnp.outer(v_t, k_t)
        P = update(P, k_t)
        return (C, P), _mv(C, _mv(P, q_t))

    return _scan(step, q, k, v, lam)


def _atk(q, k, v, lam, update):
    def step(carry, x):
        S, P = carry
        q_t, k_t, v_t = x
        Pk = _mv(P, k_t)
        k_tilde = Pk / (1.0 + _mv(k_t, Pk))
        S = S + jnp.outer(v_t - _mv(S, k_t), k_tilde)
        P = update(P, k_t)
        return (S, P), _mv(S, q_t)

    return _scan(step, q, k, v, lam)


def exact_atq(q, k, v, lam):
    """o_t = C_t P_t q_t with exact P_t = G_t^-1 (Sherman–Morrison); o [T, V]."""
    return _atq(q, k, v, lam, _sherman_morrison)


def exact_atk(q, k, v, lam):
    """o_t = S_t q_t with k̃_t = P_{t−1}k_t / (1 + k_tᵀP_{t−1}k_t), exact P; o [T, V]."""
    return _atk(q, k, v, lam, _sherman_morrison)


def diagonal_atq(q, k, v, lam):
    """ATQ with P_t = Diag(1 / (λ + Σ_{i≤t} k_i ⊙ k_i)); o [T, V]."""
    return _atq(q, k, v, lam, _diagonal)


def diagonal_atk(q, k, v, lam):
    """ATK with P_{t−1} = Diag(1 / (λ + Σ_{i<t} k_i ⊙ k_i)) in k̃_t; o [T, V]."""
    return _atk(q, k, v, lam, _diagonal)
