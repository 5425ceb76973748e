"""pallas_kernels/rows_mosaic.py: what the per-coordinate Mosaic kernels share."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import rows_mosaic


@pytest.mark.parametrize("reverse", [False, True])
def test_token_groups_keep_the_order(reverse):
    """``tokens`` as compiled (loads of ``GROUP`` tokens ahead of their steps; interpret mode
    runs one a step, so the kernels' tests do not see the grouping): every token once, in
    order (descending when ``reverse``), each step given its own token's loads."""
    x = jax.random.normal(jax.random.PRNGKey(0), (rows_mosaic.TILE,))
    got = rows_mosaic.tokens(lambda t: (x[t], t), lambda t, v, c: c * 0.5 + v[0] * (v[1] == t),
                              jnp.float32(1.0), interpret=False, reverse=reverse)
    want = 1.0
    for t in (reversed(range(rows_mosaic.TILE)) if reverse else range(rows_mosaic.TILE)):
        want = want * 0.5 + x[t]
    assert rows_mosaic.GROUP > 1 and abs(float(got) - float(want)) < 1e-6
