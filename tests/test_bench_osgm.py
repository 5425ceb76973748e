"""bench_osgm's variant strings (a misread variant costs a device call; no "scalar": scalar_aux
False, no "pN": the token loops, whatever the defaults)."""

import pytest

from benchmarks.bench_osgm import variant
from pallas_kernels.osgm_precond import Options


@pytest.mark.parametrize("text, options", [
    ("4/1", Options(prefetch=4, num_warps=1, scalar_aux=False, picard_iters=0, mosaic_loops=False)),
    ("2/1/4/scalar", Options(prefetch=2, num_warps=1, unroll=4, scalar_aux=True, picard_iters=0,
                             mosaic_loops=False)),
    ("2/1/16/8", Options(prefetch=2, num_warps=1, unroll=16, bwd_unroll=8, scalar_aux=False,
                         picard_iters=0, mosaic_loops=False)),
    ("2/1/8/p8/bk64", Options(prefetch=2, num_warps=1, unroll=8, scalar_aux=False,
                              picard_iters=8, mosaic_loops=False, picard_block_k=64, picard_early_exit=True)),
    ("2/1/8/scalar/p6/fixed", Options(prefetch=2, num_warps=1, unroll=8, scalar_aux=True,
                                      picard_iters=6, mosaic_loops=False, picard_early_exit=False)),
    ("2/1/16/8/scalar/p4/cp8", Options(prefetch=2, num_warps=1, unroll=16, bwd_unroll=8,
                                       scalar_aux=True, picard_iters=4, mosaic_loops=False, picard_pieces=8,
                                       picard_early_exit=True)),
    ("2/1/16/scalar/p4/fixed/cpauto", Options(prefetch=2, num_warps=1, unroll=16, scalar_aux=True,
                                              picard_iters=4, mosaic_loops=False, picard_early_exit=False,
                                              picard_pieces=None)),
    ("2/1/16/8/scalar/mosaic", Options(prefetch=2, num_warps=1, unroll=16, bwd_unroll=8,
                                       scalar_aux=True, picard_iters=0, mosaic_loops=True)),
    ("2/1/8/mosaic/wg1", Options(prefetch=2, num_warps=1, unroll=8, scalar_aux=False,
                                 picard_iters=0, mosaic_loops=True, mosaic_warpgroups=1)),
    ("2/1/16/scalar/mosaic/st1", Options(prefetch=2, num_warps=1, unroll=16, scalar_aux=True,
                                         picard_iters=0, mosaic_loops=True, stream=1)),
    ("2/1/8/mosaic/bitstop", Options(prefetch=2, num_warps=1, unroll=8, scalar_aux=False,
                                     picard_iters=0, mosaic_loops=True, mosaic_bound_stop=False)),
    ("2/1/8/mosaic/bound", Options(prefetch=2, num_warps=1, unroll=8, scalar_aux=False,
                                   picard_iters=0, mosaic_loops=True, mosaic_bound_stop=True)),
])
def test_variant_strings(text, options):
    assert variant(text) == options


@pytest.mark.parametrize("text", ["2", "2/1/8/8/8", "2/x/8", "2/1/0", "2/1/p8/8", "2/1/q4",
                                  "2/1/8/p4/cpx", "2/1/8/mosaic/wg3",
                                  "2/1/8/mosaic/st0", "2/1/8/mosaic/stx",
                                  "2/1/8/mosaic/bitstop/bound", "2/1/8/mosaic/ug", "2/1/8/mosaic/fo",
                                  "2/1/8/mosaic/tg"])
def test_bad_variant_strings_raise(text):
    with pytest.raises(ValueError):
        variant(text)


@pytest.mark.parametrize("B, T", [(1, 128), (2, 128), (8, 2048)])
def test_packed_check_inputs(B, T):
    """The packed check's row: the B rows as one of B T tokens, documents with boundaries
    strictly increasing from 0 to B T (one of a single token), a d_1 each."""
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_osgm import make_inputs, packed
    x, key = make_inputs(jax.random.key(0), B, T, 2, 16, jnp.float32)
    rows, cu = packed(x, key)
    assert rows["k"].shape == (1, B * T, 2, 16) and rows["beta"].shape == (1, B * T, 2)
    assert int(cu[0]) == 0 and int(cu[-1]) == B * T and bool(jnp.all(jnp.diff(cu) > 0))
    assert 1 in jnp.diff(cu).tolist() and rows["d0"].shape == (len(cu) - 1, 2, 16)
    if B > 1:  # row order kept
        assert jnp.array_equal(rows["k"][0, T:2 * T], x["k"][1])
