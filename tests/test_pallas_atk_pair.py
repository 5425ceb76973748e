"""The ATK Mosaic kernels on two warpgroups (``atk_mosaic.atk_fwd`` / ``atk_bwd``
``(warpgroups=2)``, ``atk_precond.Options.mosaic_warpgroups``; ``rows_mosaic.walk_pair``): the
same arithmetic as on one, so the same results (bits, but for one fold XLA makes in interpret
mode), over enough tiles that a buffer slot is reused, with packed documents too
(test_pallas_atk_mosaic checks both against the reference). And their lowering for CUDA."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.mosaic_barriers import barriers, modules
from pallas_kernels import atk_mosaic
from test_pallas_atk import make_inputs
from test_pallas_osgm_pair import assert_same_bits

HYPER = (math.log(1.5), 1e-6)


def kernel_inputs(seed, *, t, packed=False):
    """(k [1, t, 1, 128] bf16, coefficient rows, initial states) with some decays near −8 (α
    tiny) and, when ``packed``, documents of 3, 100 and t − 103 tokens (boundaries inside the
    first and second tiles; an initial state each)."""
    x = make_inputs(seed, b=1, t=t, h=1, k_dim=128, n_init=3 if packed else 1,
                    dtype=jnp.bfloat16)
    f32 = {n: x[n].astype(jnp.float32) for n in ("log_decay", "gain")}
    center = jnp.broadcast_to(x["center"].astype(jnp.float32), f32["gain"].shape)
    docs = None
    if packed:
        pos = jnp.arange(t)[None]
        docs = (jnp.where(pos < 3, 0, jnp.where(pos < 103, 1, 2)), jnp.isin(pos, jnp.asarray(
            [0, 3, 103])), jnp.isin(pos, jnp.asarray([2, 102, t - 1])))
    rows = atk_mosaic.coefficient_rows(f32["gain"], f32["log_decay"], center, t, docs)
    return x["k"], rows, x["initial_state"]


@pytest.mark.parametrize("packed", [False, True])
def test_two_warpgroups_give_the_same_bits(packed):
    """Three tiles (slot 0's buffers reused once): the forward's k̃, final states and the states
    entering the tiles bit for bit those of one warpgroup, the backward's ∂k too, its rows
    (∂gain, −Σ q, ∂g) and ∂initial within 1e-6: the one-warpgroup kernel divides q_t by A_t + ε
    right after forming it, which XLA's simplifier (interpret mode) folds into one division (A
    / B / C -> A / (B C)); two warpgroups pass q_t through shared memory in between, as the GPU
    lowering, which does not fold, keeps them apart anyway. With packed documents (a boundary
    inside a tile, one spanning three) each document's states too."""
    k, rows, init = kernel_inputs(21, t=192, packed=packed)
    fwd = functools.partial(atk_mosaic.atk_fwd, hyper=HYPER, interpret=True, packed=packed,
                            residuals=True)
    one, two = fwd(k, rows, init, warpgroups=1), fwd(k, rows, init, warpgroups=2)
    assert_same_bits(one, two)
    dkw, dfinal = kernel_inputs(23, t=192, packed=packed)[::2]  # ∂k̃ bf16, ∂final
    args = (k, dkw, rows, one[2], init, dfinal)
    bwd = functools.partial(atk_mosaic.atk_bwd, hyper=HYPER, interpret=True, packed=packed)
    one, two = bwd(*args, warpgroups=1), bwd(*args, warpgroups=2)
    assert jnp.array_equal(one[0], two[0])  # ∂k, rounded to bf16
    for a, b in zip(one[1:], two[1:], strict=True):  # XLA's A / B / C (above)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6,
                                   atol=1e-6 * float(jnp.max(jnp.abs(a))))


def test_lowers_for_cuda():
    """Both kernels on two warpgroups through Mosaic GPU's passes with packed documents, three
    tiles: one kernel each, no warpgroup barrier inside a token loop (depth 3 with the pair's
    branch)."""
    s = jax.ShapeDtypeStruct
    seq, state = s((1, 192, 2, 128), jnp.bfloat16), s((3, 2, 128), jnp.float32)
    static = dict(hyper=HYPER, interpret=False, packed=True, warpgroups=2)
    fwd = functools.partial(atk_mosaic.atk_fwd, residuals=True, **static)
    bwd = functools.partial(atk_mosaic.atk_bwd, **static)
    rows, starts = s((1, 2, 6, 192), jnp.float32), s((1, 3, 2, 128), jnp.float32)
    for fn, args, name in [(fwd, (seq, rows, state), "atk_fwd_mosaic"),
                           (bwd, (seq, seq, rows, starts, state, state), "atk_bwd_mosaic")]:
        found = modules(fn, args)
        assert list(found) == [name]
        assert max(barriers(found[name])) == 2


def test_bad_warpgroups_raise():
    k, rows, init = kernel_inputs(22, t=64)
    for bad, match in ((3, "warpgroups must be 1 or 2"), (2, "16-bit")):
        with pytest.raises(ValueError, match=match):
            atk_mosaic.atk_fwd(k if bad == 3 else k.astype(jnp.float32), rows, init,
                               hyper=HYPER, interpret=True, warpgroups=bad)
    starts = jnp.ones((1, 1, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match="∂k̃ in k's dtype"):
        atk_mosaic.atk_bwd(k, k.astype(jnp.float16), rows, starts, init, init, hyper=HYPER,
                           interpret=True, warpgroups=2)
