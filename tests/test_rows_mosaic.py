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


def test_rows_are_pinned_row_major():
    """``rows_layout`` and ``token_rows`` pin every [B, T, H] row row-major (the compiled
    program's layouts then leave the layer's reductions alone, ``row_major``), and keep the
    values: the layout [B, H, n, Tp] with the ``ones`` row padded with ones, and back."""
    B, T, H, Tp = 2, 5, 3, 8
    rows = [jax.random.normal(jax.random.PRNGKey(i), (B, T, H)) for i in range(3)]
    lay = jax.jit(lambda r: rows_mosaic.rows_layout(r, None, Tp, 1))
    text = lay.lower(rows).as_text()
    assert text.count("@LayoutConstraint") == 3 and "result_layouts = [dense<[2, 1, 0]>" in text
    x = lay(rows)
    assert x.shape == (B, H, 3, Tp) and bool(jnp.all(x[:, :, 1, T:] == 1.0))
    assert bool(jnp.all(x[:, :, 0, T:] == 0.0))
    back = jax.jit(lambda x: rows_mosaic.token_rows(x, T))
    assert back.lower(x).as_text().count("@LayoutConstraint") == 3
    for got, want in zip(back(x), rows):
        assert bool(jnp.all(got == want))
