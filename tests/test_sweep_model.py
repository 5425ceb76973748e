"""benchmarks/sweep_model.py, the NumPy model of the Mosaic OSGM kernels' sweep counts: its
sweeps compute the token loop's d (so its counts are of the real algorithm), and the first
guesses it compares save sweeps where it says they do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond_linattn as pla
from benchmarks import sweep_model
from benchmarks.bench_osgm import make_inputs


@pytest.mark.parametrize("apf", [True, False])
def test_model_sweeps_reach_the_token_loop_and_guesses_save_sweeps(apf):
    """Two heads of 256 tokens (bench_osgm's inputs, η = 0.003; with APF retention d comes
    down onto d_min, the clip active): every guess's final d is the reference token loop's
    (float32, to 1e-6); the kernels' guesses need at least 2 sweeps forward and 3 backward a
    tile; the first-order ones need fewer in all, and never more than 3 a tile; the backward's
    tile-product guess at most 2 without retention (no mask cuts), and with the contraction
    bound there the first-order guesses take one sweep a tile each way."""
    x, key = make_inputs(jax.random.PRNGKey(1), 1, 256, 2, 128, jnp.bfloat16)
    dkw = jax.random.normal(key, x["k"].shape, jnp.bfloat16)
    f32 = {n: x[n].astype(jnp.float32) for n in ("k", "beta", "r")}
    _, want = pla.osgm_precondition(f32["k"], f32["beta"], retention=f32["r"] if apf else None,
                                    initial_state=x["d0"], output_final_state=True,
                                    impl="reference")
    counts = {}
    for fg, bg in (("retained", "zero"), ("first_order", "first_order"), ("first_order", "tile")):
        fwd, bwd, final = sweep_model.sweeps(x, dkw, apf=apf, forward_guess=fg,
                                             backward_guess=bg)
        np.testing.assert_allclose(final, np.asarray(want[0]), rtol=1e-6, atol=1e-6)
        counts[bg] = (np.asarray(fwd), np.asarray(bwd))
    if apf:
        assert float(np.mean(want[0] == 0.5)) > 0.5  # pinned on d_min: the clip matters
    (f0, b0), (f1, b1), (_, b2) = (counts[g] for g in ("zero", "first_order", "tile"))
    assert f0.min() >= 2 and b0.min() >= 3
    assert f1.sum() < f0.sum() and b1.sum() < b0.sum() and max(f1.max(), b1.max()) <= 3
    if not apf:  # tile products: exact without mask cuts only (with APF's, 4 in some tiles)
        assert b2.max() <= 2
        # and with the contraction bound (the kernels' bound_stop) one sweep a tile each way
        fwd, bwd, final = sweep_model.sweeps(x, dkw, apf=False, forward_guess="first_order",
                                             backward_guess="tile", bound=True)
        np.testing.assert_allclose(final, np.asarray(want[0]), rtol=1e-6, atol=1e-6)
        assert max(fwd) == max(bwd) == 1
