"""The OSGM Mosaic forward on two warpgroups (``osgm_mosaic.osgm_fwd(warpgroups=2)``,
``Options.mosaic_warpgroups``; ``rows_mosaic.walk_pair``): the same arithmetic as on one, so the
same bits (k̃, the final states and the backward's residuals), over enough tiles that a buffer
slot is reused, with packed documents too: so it is as exact as the one-warpgroup forward,
which test_pallas_osgm_mosaic checks against the reference. And the lowering for CUDA."""

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks.mosaic_barriers import barriers, modules
from pallas_kernels import osgm_mosaic
from pallas_kernels.osgm_precond import Options
from precond_linattn.chunked.osgm_picard import coefficients
from test_pallas_osgm import make_inputs


def kernel_inputs(seed, *, b, t, packed=False):
    """(k [b, t, 2, 128] bf16, coefficient rows, initial states) with the clip active (η = 2,
    skewed keys) and, when ``packed``, documents of 3, 100 and t − 103 tokens in each row
    (boundaries inside the first and second tiles; initial states per document)."""
    x = make_inputs(seed, b=b, t=t, k_dim=128, n_init=3 * b if packed else b, skewed=True,
                    dtype=jnp.bfloat16)
    f32 = {n: x[n].astype(jnp.float32) for n in ("k", "beta", "retention")}
    coefs = coefficients(f32["k"], f32["beta"], f32["retention"], 2.0, True, 1e-6)
    docs = None
    if packed:
        pos = jnp.arange(t)
        within = jnp.where(pos < 3, 0, jnp.where(pos < 103, 1, 2))
        doc = jnp.broadcast_to(within + 3 * jnp.arange(b)[:, None], (b, t))
        first = jnp.isin(pos, jnp.asarray([0, 3, 103]))
        last = jnp.isin(pos, jnp.asarray([2, 102, t - 1]))
        docs = (doc, jnp.broadcast_to(first, (b, t)), jnp.broadcast_to(last, (b, t)))
    return x["k"], osgm_mosaic.coefficient_rows(coefs, t, docs), x["initial_state"]


@pytest.mark.parametrize("packed", [False, True])
def test_two_warpgroups_give_the_same_bits(packed):
    """Three tiles (slot 0's S, D, k̃ and input buffers reused once): k̃, the final states
    and the backward's residuals (u_t, a_t, the states entering the tiles) bit for bit
    those of one warpgroup, with the clip active; with packed documents (a boundary inside a
    tile, one spanning three) each document's final state too."""
    args = kernel_inputs(11, b=1, t=192, packed=packed)
    fwd = functools.partial(osgm_mosaic.osgm_fwd, bounds=(0.5, 2.0), interpret=True,
                            packed=packed, residuals=True)
    one, two = fwd(*args, warpgroups=1), fwd(*args, warpgroups=2)
    assert float(jnp.mean((one[1] == 0.5) | (one[1] == 2.0))) > 0.1  # the clip pins some
    for a, b in zip(one, two):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert jnp.array_equal(a, b)


def test_lowers_for_cuda():
    """Through Mosaic GPU's passes with packed documents and residuals, three tiles: one
    kernel, no warpgroup barrier inside a token loop (the chain's tokens at depth 3)."""
    s = jax.ShapeDtypeStruct
    args = (s((2, 192, 2, 128), jnp.bfloat16), s((2, 2, 6, 192), jnp.float32),
            s((5, 2, 128), jnp.float32))
    fwd = lambda k, c, i: osgm_mosaic.osgm_fwd(k, c, i, bounds=(0.5, 2.0), interpret=False,  # noqa: E731
                                               packed=True, residuals=True, warpgroups=2)
    found = modules(fwd, args)
    assert list(found) == ["osgm_fwd_mosaic"]
    assert max(barriers(found["osgm_fwd_mosaic"])) == 2


def test_bad_warpgroups_raise():
    with pytest.raises(ValueError, match="mosaic_warpgroups must be 1 or 2"):
        Options(mosaic_warpgroups=3)
    k = jnp.zeros((1, 64, 1, 128), jnp.float32)
    for warpgroups, dtype, match in [(4, jnp.bfloat16, "warpgroups must be 1 or 2"),
                                     (2, jnp.float32, "takes 16-bit keys")]:
        with pytest.raises(ValueError, match=match):
            osgm_mosaic.osgm_fwd(k.astype(dtype), jnp.zeros((1, 1, 3, 64)),
                                 jnp.ones((1, 1, 128)), bounds=(0.5, 2.0), interpret=True,
                                 warpgroups=warpgroups)
