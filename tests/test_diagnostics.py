"""The residual-ratio diagnostic: measured ratios, closed form, masking of zero residuals."""

import jax.numpy as jnp
import numpy as np

from conftest import rel_err
from precond_linattn.diagnostics import ratio_summary, residual_ratio


def test_ratio_equals_closed_form(rand):
    B, T, H, K, V = 2, 15, 3, 8, 4
    inp = rand.delta_inputs(B, T, H, K, V, "vector")
    ratio, mask = residual_ratio(inp["k"], inp["v"], inp["beta"], write_key=inp["write_key"],
                                 log_decay=inp["log_decay"], initial_state=rand.normal(B, H, K, V))
    assert ratio.shape == (B, T, H) and bool(mask.all())
    a = inp["beta"] * jnp.sum(inp["write_key"] * inp["k"], -1)
    assert rel_err(ratio, (1 - a) ** 2) <= 1e-4


def test_zero_residuals_are_masked_not_divided(rand):
    K, V = 8, 4
    k = jnp.broadcast_to(rand.unit(1, 1, 1, K), (1, 3, 1, K))
    v = jnp.broadcast_to(rand.normal(1, 1, 1, V), (1, 3, 1, V))
    beta = jnp.ones((1, 3, 1))
    # token 0 writes v exactly (β = 1, unit key); tokens 1 and 2 repeat it: zero residual
    ratio, mask = residual_ratio(k, v, beta)
    assert mask.tolist() == [[[True], [False], [False]]]
    assert np.isnan(np.asarray(ratio[0, 1:])).all()
    q_geo, q_arith = ratio_summary(ratio, mask)
    assert np.isfinite(float(q_geo)) and np.isfinite(float(q_arith))


def test_summary_geo_and_arith(rand):
    ratio = jnp.asarray([[[0.25], [1.0], [jnp.nan]]])
    mask = jnp.asarray([[[True], [True], [False]]])
    q_geo, q_arith = ratio_summary(ratio, mask)
    assert abs(float(q_geo) - 0.5) < 1e-6 and abs(float(q_arith) - 0.625) < 1e-6
