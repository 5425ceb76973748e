"""The OSGM Mosaic kernels on two warpgroups (``osgm_mosaic.osgm_fwd`` / ``osgm_bwd``
``(warpgroups=2)``, ``Options.mosaic_warpgroups``; ``rows_mosaic.walk_pair``): the same
arithmetic as on one, so the same bits, over enough tiles that a buffer slot is reused, with
packed documents too: so they are as exact as the one-warpgroup kernels, which
test_pallas_osgm_mosaic checks against the reference. And their lowering for CUDA."""

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
    """(k [b, t, 1, 128] bf16, coefficient rows, initial states) with the clip active (η = 2,
    skewed keys) and, when ``packed``, documents of 3, 100 and t − 103 tokens in each row
    (boundaries inside the first and second tiles; initial states per document)."""
    x = one_head(make_inputs(seed, b=b, t=t, k_dim=128, n_init=3 * b if packed else b,
                             skewed=True, dtype=jnp.bfloat16))
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
    """Three tiles (slot 0's buffers reused once), the clip active: the forward's k̃, final
    states and residuals (u_t, a_t, the states entering the tiles), and the backward's ∂k
    (in k's dtype: one warpgroup's float32 ∂k rounded), γ, ∂r and ∂d_1 from them, bit for bit
    those of one warpgroup; with packed documents (a boundary inside a tile, one spanning
    three) each document's states too."""
    k, rows, init = kernel_inputs(11, b=1, t=192, packed=packed)
    static = dict(bounds=(0.5, 2.0), interpret=True, packed=packed)
    fwd = functools.partial(osgm_mosaic.osgm_fwd, residuals=True, **static)
    one, two = fwd(k, rows, init, warpgroups=1), fwd(k, rows, init, warpgroups=2)
    assert float(jnp.mean((one[1] == 0.5) | (one[1] == 2.0))) > 0.1  # the clip pins some
    assert_same_bits(one, two)
    x = one_head(make_inputs(12, b=1, t=192, k_dim=128, n_init=init.shape[0],
                             dtype=jnp.bfloat16))
    u, a = (jnp.moveaxis(one[2][:, :, j], 1, 2) for j in range(2))
    coefs = coefficients(k.astype(jnp.float32), rows[:, :, 1].swapaxes(1, 2),
                         rows[:, :, 2].swapaxes(1, 2), 2.0, True, 1e-6)
    b_rows = functools.partial(osgm_mosaic.backward_rows, coefs, u, a, 1e-6, 192,
                               docs_of(rows) if packed else None)
    args = (k, x["k"], b_rows(), one[3], init, x["initial_state"])  # ∂k̃ bf16, dfinal
    bwd = functools.partial(osgm_mosaic.osgm_bwd, **static)
    one, two = bwd(*args, warpgroups=1), bwd(*args, warpgroups=2)
    assert one[0].dtype == jnp.float32 and two[0].dtype == k.dtype  # ∂k rounded in the kernel
    assert_same_bits((one[0].astype(k.dtype), *one[1:]), two)


def one_head(x):
    """``make_inputs``' arrays cut to their first head (interpret time goes with the CTAs)."""
    return {n: v[..., :1, :] if v.ndim == 4 or n == "initial_state" else v[..., :1]
            for n, v in x.items()}


def docs_of(rows):
    """The document rows (ids, first and last flags) [B, T] of forward coefficient rows."""
    return tuple(rows[:, 0, j] for j in range(osgm_mosaic.P + 1, osgm_mosaic.P + 4))


def assert_same_bits(one, two):
    for a, b in zip(one, two, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert jnp.array_equal(a, b)


def test_lowers_for_cuda():
    """Both kernels through Mosaic GPU's passes with packed documents (and the forward's
    residuals), three tiles: one kernel each, no warpgroup barrier inside a token loop (the
    chain's tokens at depth 3)."""
    s = jax.ShapeDtypeStruct
    seq, state = s((2, 192, 2, 128), jnp.bfloat16), s((5, 2, 128), jnp.float32)
    static = dict(bounds=(0.5, 2.0), interpret=False, packed=True, warpgroups=2)
    fwd = functools.partial(osgm_mosaic.osgm_fwd, residuals=True, **static)
    bwd = functools.partial(osgm_mosaic.osgm_bwd, **static)
    for fn, args, name in [
            (fwd, (seq, s((2, 2, 7, 192), jnp.float32), state), "osgm_fwd_mosaic"),
            (bwd, (seq, seq, s((2, 2, 7, 192), jnp.float32),
                   s((2, 3, 2, 128), jnp.float32),
                   state, state), "osgm_bwd_mosaic")]:
        found = modules(fn, args)
        assert list(found) == [name]
        assert max(barriers(found[name])) == 2


def test_bad_warpgroups_raise():
    with pytest.raises(ValueError, match="mosaic_warpgroups must be 1 or 2"):
        Options(mosaic_warpgroups=3)
    k = jnp.zeros((1, 64, 1, 128), jnp.float32)
    for warpgroups, dtype, match in [(4, jnp.bfloat16, "warpgroups must be 1 or 2"),
                                     (2, jnp.float32, "takes 16-bit inputs")]:
        with pytest.raises(ValueError, match=match):
            osgm_mosaic.osgm_fwd(k.astype(dtype), jnp.zeros((1, 1, 3, 64)),
                                 jnp.ones((1, 1, 128)), bounds=(0.5, 2.0), interpret=True,
                                 warpgroups=warpgroups)


def test_sweep_counts():
    """At the paper's settings without retention (OSDN: bench_osgm's unit keys, η = 0.003,
    bf16), two tiles on two warpgroups: the forward settles in 3 sweeps a tile (as
    ``benchmarks/sweep_model.py`` counts), the backward in 3 or more; with the contraction
    bound (``bound_stop``) the forward stops no later, within a quarter spacing of the fixed
    point (at most an ulp of the bitwise results after rounding). Counted by probe_sweeps'
    counting ``_settle`` (whose a and γ rows carry the counts)."""
    import jax.random as jr
    from benchmarks import probe_sweeps
    from benchmarks.bench_osgm import make_inputs as bench_inputs
    x, key = bench_inputs(jr.PRNGKey(3), 1, 128, 1, 128, jnp.bfloat16)
    f32 = {n: x[n].astype(jnp.float32) for n in ("k", "beta")}
    coefs = coefficients(f32["k"], f32["beta"], None, 0.003, True, 1e-6)
    rows, init = osgm_mosaic.coefficient_rows(coefs, 128), jnp.ones((1, 1, 128), jnp.float32)
    static = dict(bounds=(0.5, 2.0), interpret=True, warpgroups=2)
    fwd = functools.partial(osgm_mosaic.osgm_fwd, x["k"], rows, init, residuals=True, **static)
    plain = fwd()
    u, a = (jnp.moveaxis(plain[2][:, :, i], 1, 2) for i in range(2))
    dkw = jr.normal(key, x["k"].shape, jnp.bfloat16)
    rows_b = osgm_mosaic.backward_rows(coefs, u, a, 1e-6, 128)
    bounded = fwd(bound_stop=True)[:2]
    for got, want in zip(bounded, plain[:2]):
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) <= 4 * 2.0 ** -24 * scale
    real = osgm_mosaic._settle
    osgm_mosaic._settle = probe_sweeps.counting_settle
    try:
        forward = fwd()[2][0, 0, 1, ::osgm_mosaic.TILE] % 1000
        backward = osgm_mosaic.osgm_bwd(x["k"], dkw, rows_b, plain[3], init, init * 0.1,
                                        **static)[1][0, 0, 0, ::osgm_mosaic.TILE] % 1000
        once = fwd(bound_stop=True)[2][0, 0, 1, ::osgm_mosaic.TILE] % 1000
    finally:
        osgm_mosaic._settle = real
    assert jnp.all(forward == 3), forward
    assert jnp.all(backward >= 3), backward
    assert jnp.all((once >= 1) & (once <= forward)), once
