"""The OSGM d scan by Picard iterations (``chunked.osgm_picard``) against the token-by-token
reference: forward and every gradient, dense and packed, β-aware and β-free, with the clip active;
the iterations it takes at the paper's step size; the fallback where they do not converge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_runs_match, fixed_loss_run
from test_pallas_osgm import D_MAX, D_MIN, clipped_fraction, make_inputs

import precond_linattn as pla
from precond_linattn.chunked.osgm_picard import osgm_picard, osgm_picard_steps


def picard(x, *, eta, beta_aware=True, retention=True, cu_seqlens=None, max_iters=16):
    return osgm_picard(x["k"], x["beta"], x["retention"] if retention else None, eta, D_MIN,
                       D_MAX, beta_aware, 1e-6, x["initial_state"], cu_seqlens,
                       max_iters=max_iters)


def reference(x, *, eta, beta_aware=True, retention=True, cu_seqlens=None):
    return pla.osgm_precondition(
        x["k"], x["beta"], eta=eta, d_min=D_MIN, d_max=D_MAX,
        retention=x["retention"] if retention else None, beta_aware=beta_aware,
        initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu_seqlens,
        impl="reference")


def steps(x, eta, **kw):
    r = x["retention"] if kw.pop("retention", True) else None
    return int(osgm_picard_steps(x["k"], x["beta"], r, eta, D_MIN, D_MAX, True, 1e-6,
                                 x["initial_state"], kw.get("cu_seqlens")))


@pytest.mark.parametrize("case", ["aware APF", "free", "packed"])
def test_matches_reference_with_the_clip_active(case):
    """η = 2 on skewed keys (a quarter to a half of the coordinates end on a bound), T = 37: k̃,
    the final d and the gradients of k, β, r, d_1 within 2e-5 of the reference, by Picard (the
    iterations converge: no fallback)."""
    packed = case == "packed"
    x = make_inputs(3, b=1 if packed else 2, n_init=3 if packed else 2, skewed=True)
    kw = dict(eta=2.0, beta_aware=case != "free", retention=case != "free")
    if packed:
        kw["cu_seqlens"] = jnp.asarray([0, 5, 6, 37], jnp.int32)
    assert clipped_fraction(x, 2.0, cu_seqlens=kw.get("cu_seqlens")) > 0.2
    assert steps(x, **kw) > 0
    got = fixed_loss_run(lambda x: picard(x, **kw), x)
    assert_runs_match(got, fixed_loss_run(lambda x: reference(x, **kw), x), 2e-5)


def test_few_iterations_at_the_paper_step_size():
    """η = 0.003, unit keys, T = 512, APF retention σ(x + 6): the coupling converges in <= 6
    iterations; k̃ and final d within 2e-5 of the reference."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 512, 2, 64))
    x = dict(k=jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32),
             beta=jax.nn.sigmoid(jnp.asarray(rng.standard_normal((1, 512, 2)), jnp.float32)),
             retention=jax.nn.sigmoid(jnp.asarray(rng.standard_normal((1, 512, 2)) + 6,
                                                  jnp.float32)),
             initial_state=jnp.ones((1, 2, 64), jnp.float32))
    assert 0 < steps(x, 0.003) <= 6
    for a, b in zip(picard(x, eta=0.003), reference(x, eta=0.003)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_falls_back_to_the_token_scan():
    """Two iterations allowed at η = 2: no convergence, the token scan runs (steps -1), and the
    results and gradients are still the reference's."""
    x = make_inputs(4, skewed=True)
    r = x["retention"]
    assert int(osgm_picard_steps(x["k"], x["beta"], r, 2.0, D_MIN, D_MAX, True, 1e-6,
                                 x["initial_state"], None, max_iters=2)) == -1
    got = fixed_loss_run(lambda x: picard(x, eta=2.0, max_iters=2), x)
    assert_runs_match(got, fixed_loss_run(lambda x: reference(x, eta=2.0), x), 2e-5)
