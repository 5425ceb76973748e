"""SPEC 4 facts beyond OSDN: Theorem 3.1 (exact ATQ == ATK), its failure for the diagonal
approximation, the PGDN transition spectrum, and the delta core (write key k̃ = k, shape fuzz)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import precond_linattn as pla
from conftest import Rand, rel_err
from precond_linattn.reference.delta import delta_step
from precond_linattn.reference.exact import diagonal_atk, diagonal_atq, exact_atk, exact_atq

NSEQ, T, K, V = 3, 48, 8, 6


def sequences(rand):
    """q, k [NSEQ, T, K], v [NSEQ, T, V] in float64 numpy."""
    return (rand.rng.standard_normal(shape) for shape in ((NSEQ, T, K), (NSEQ, T, K), (NSEQ, T, V)))


def run64(fn, q, k, v, lam):
    """A batched exact reference in float64: float32 rounding times cond(G) (up to ~200 at
    λ = 0.1) reaches 3e-5, which would hide an O(1e-5) algebra slip."""
    with jax.enable_x64(True):
        args = (jnp.asarray(a, jnp.float64) for a in (q, k, v))
        o = jax.vmap(fn, (0, 0, 0, None))(*args, lam)
        assert o.dtype == jnp.float64
        return np.asarray(o)


def stepwise_err(o, o_ref):
    """max over sequences and steps of ‖o_t − o_ref_t‖ / ‖o_ref_t‖."""
    return float((np.linalg.norm(o - o_ref, axis=-1) / np.linalg.norm(o_ref, axis=-1)).max())


@pytest.mark.parametrize("lam", [0.1, 1.0, 3.0])
def test_exact_atq_is_ridge_regression(rand, lam):
    q, k, v = sequences(rand)
    G = lam * np.eye(K) + np.cumsum(np.einsum("ntk,ntl->ntkl", k, k), axis=1)
    C = np.cumsum(np.einsum("ntv,ntk->ntvk", v, k), axis=1)
    want = np.einsum("ntvk,ntk->ntv", C, np.linalg.solve(G, q[..., None])[..., 0])
    want_diag = np.einsum("ntvk,ntk->ntv", C, q / np.diagonal(G, axis1=-2, axis2=-1))
    assert stepwise_err(run64(exact_atq, q, k, v, lam), want) <= 1e-10
    assert stepwise_err(run64(diagonal_atq, q, k, v, lam), want_diag) <= 1e-10


@pytest.mark.parametrize("lam", [0.1, 1.0, 3.0])
def test_theorem_exact_atq_equals_atk(rand, lam):
    args = (*sequences(rand), lam)
    assert stepwise_err(run64(exact_atk, *args), run64(exact_atq, *args)) <= 1e-10
    # the diagonal approximation breaks the theorem: an O(1) gap
    assert rel_err(run64(diagonal_atk, *args), run64(diagonal_atq, *args)) >= 0.1


@pytest.mark.parametrize("seed", range(4))
def test_pgdn_transition_spectrum(seed):
    rand = Rand(seed)
    k, kw = rand.unit(1, 1, K), rand.normal(1, 1, K)
    beta = jnp.asarray(rand.rng.uniform(0.05, 1.95, (1, 1)), jnp.float32)
    g = -jnp.asarray(rand.rng.uniform(0.01, 1.5, (1, 1)), jnp.float32)
    alpha, b = float(jnp.exp(g[0, 0])), float(beta[0, 0])
    # with v = 0 the delta step is linear in S; applied to S = I it returns its matrix (V = K):
    # α(I − β k̃ kᵀ) in the K × V state layout, the transpose of α(I − β k k̃ᵀ), same spectrum
    S = jnp.eye(K, dtype=jnp.float32)[None, None]
    M, _, _, _ = delta_step(S, k, k, kw, jnp.zeros((1, 1, K)), beta, g, 1.0)
    M = np.asarray(M[0, 0], np.float64)
    k64, kw64 = np.asarray(k[0, 0], np.float64), np.asarray(kw[0, 0], np.float64)
    np.testing.assert_allclose(M, alpha * (np.eye(K) - b * np.outer(kw64, k64)), atol=1e-6)
    eig = np.linalg.eigvals(M)
    assert np.abs(eig.imag).max() <= 1e-6
    want = np.array([alpha] * (K - 1) + [alpha * (1 - b * k64 @ kw64)])
    np.testing.assert_allclose(np.sort(eig.real), np.sort(want), atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("decay", [None, "scalar", "vector"])
def test_write_key_equal_to_key_is_plain_backbone(rand, impl, decay):
    inp = rand.delta_inputs(2, 37, 3, K, V, decay)
    args = (inp["q"], inp["k"], inp["v"], inp["beta"])
    kw = dict(log_decay=inp["log_decay"], impl=impl, chunk_size=16, output_final_state=True)
    o_plain, S_plain = pla.delta_rule(*args, **kw)
    o, S = pla.delta_rule(*args, write_key=inp["k"], **kw)
    np.testing.assert_array_equal(o, o_plain)
    np.testing.assert_array_equal(S, S_plain)


@pytest.mark.heavy
@settings(max_examples=15, deadline=None, database=None)
@given(B=st.integers(1, 2), T_=st.integers(1, 70), H=st.integers(1, 2),
       K_=st.sampled_from([4, 8, 16]), V_=st.sampled_from([3, 8]),
       chunk=st.sampled_from([8, 16, 32]), decay=st.sampled_from([None, "scalar", "vector"]),
       with_initial=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_delta_rule_shape_fuzz(B, T_, H, K_, V_, chunk, decay, with_initial, seed):
    rand = Rand(seed)
    inp = rand.delta_inputs(B, T_, H, K_, V_, decay)
    h0 = rand.normal(B, H, K_, V_) if with_initial else None
    args = (inp["q"], inp["k"], inp["v"], inp["beta"])
    kw = dict(write_key=inp["write_key"], log_decay=inp["log_decay"], initial_state=h0)
    # one jit per shape compiles faster than op-by-op dispatch
    reference = jax.jit(partial(pla.delta_rule, impl="reference", output_final_state=True))
    chunked = jax.jit(partial(pla.delta_rule, impl="chunked", chunk_size=chunk,
                              output_final_state=True))
    o_ref, S_ref = reference(*args, **kw)
    o, S = chunked(*args, **kw)
    assert o.shape == (B, T_, H, V_) and S.shape == (B, H, K_, V_)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(S, S_ref) <= 1e-5
