"""The per-channel WY pullback on the tensor cores (pallas_kernels/wy_vector_pullback_mosaic.py)
in interpret mode on CPU: its cotangents against the float32 pullback of ``delta_rule.prepare``
on each of its four paths, its CUDA lowering and its argument checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import delta_rule as dr
from pallas_kernels import wy_vector_mosaic, wy_vector_pullback_mosaic, wy_vector_triton
from pallas_kernels.triton_common import Dots
from conftest import jitted_vjp, mosaic_kernels_lowered_for_cuda
from test_pallas_precision import rel_rms

B, NC, C = 1, 2, 64
EXACT = Dots("ieee", interpret=True)
DECAYS = ((0.01, 1.0), (1.4, 2.4), (2.7, 4.8), (6.0, 9.0))  # per token, one head a path
H = len(DECAYS)
F32_FLOOR = 2.0 ** -20  # float32 sums' rounding (dβ of the exact head is exact to ~3e-7 in both)


def case(rand, K, V):
    """(kernel inputs, float32 reference cotangents of q, k, k̃, v, β and the log decays g)."""
    T = NC * C
    x = rand.delta_inputs(B, T, H, K, V, dtype=jnp.bfloat16)
    g = jnp.concatenate([-jnp.asarray(rand.rng.uniform(lo, hi, (B, T, 1, K)), jnp.float32)
                         for lo, hi in DECAYS], axis=2)
    gamma = jnp.cumsum(g.reshape(B, NC, C, H, K), axis=2).reshape(g.shape)
    q, k, kw, v = x["q"], x["k"], x["write_key"], x["v"]
    beta = x["beta"].astype(jnp.float32)
    *_, T_inv = jax.jit(functools.partial(wy_vector_mosaic.wy_vector_fwd, interpret=True))(
        q, k, kw, v, beta, gamma)
    cfg = dr._Config(C, "vector", 1.0, None, dr.Options(), EXACT, EXACT)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    wy, pullback = jitted_vjp(functools.partial(dr.prepare, cfg), *map(f32, (q, k, kw, v, beta, g)))
    cts = [rand.normal(*w.shape) for w in wy]
    cts = [c.astype(jnp.bfloat16).astype(jnp.float32) for c in cts[:5]] + cts[5:]
    return (q, k, kw, v, beta, gamma, T_inv, *cts), pullback(tuple(cts))


def triton_bf16(ins):
    """The Triton pullback at bf16 dots (what the op ran before), its dγ and dσ taken to dg."""
    q, k, kw, v, beta, gamma, T, *cts = ins
    T = T.astype(jnp.bfloat16).astype(jnp.float32)  # the bf16 T the Mosaic kernel reads
    *grads, dgamma, dsigma = jax.jit(functools.partial(
        wy_vector_triton.wy_vector_bwd, chunk=C, block_v=64, dots=Dots("bf16", interpret=True),
        num_warps=4, num_stages=1))(q, k, kw, v, beta, gamma, T, *cts)
    cfg = dr._Config(C, "vector", 1.0, None, dr.Options(), EXACT, EXACT)
    # the op's pullback of the decay sums (linear: any point serves)
    return (*grads, dr._log_decay_grads(cfg, jnp.zeros_like(gamma), dgamma, dsigma))


@pytest.mark.parametrize("K, V", [(128, 64), (64, 128)])
def test_matches_the_float32_pullback_on_each_path(rand, K, V):
    """dq, dk, dk̃, dv, dβ and dg against the float32 pullback of ``prepare`` (same inputs and
    bf16-valued cotangents), head h's slabs on path h: each head's relative RMS error within
    1.05x of the Triton pullback's at bf16 dots (the same operands rounded to bf16: ~2e-3 on
    dq, dk, dk̃, dv, ~1e-2 on dg, a sum of cancelling terms) plus float32 rounding."""
    ins, want = case(rand, K, V)
    paths = wy_vector_pullback_mosaic.paths(ins[5])
    assert (paths == np.arange(H)[None, None, :, None]).all()
    got = jax.jit(functools.partial(wy_vector_pullback_mosaic.wy_vector_bwd, interpret=True))(*ins)
    base = triton_bf16(ins)
    for name, a, t, b in zip(("dq", "dk", "dk̃", "dv", "dβ", "dg"), got, base, want, strict=True):
        assert a.shape == b.shape and a.dtype == (jnp.float32 if name in ("dβ", "dg")
                                                  else jnp.bfloat16), name
        for h in range(H):
            err, base_err = rel_rms(a[:, :, h], b[:, :, h]), rel_rms(t[:, :, h], b[:, :, h])
            assert err <= 1.05 * base_err + F32_FLOOR, (name, h)


def test_lowers_for_cuda():
    """Through Mosaic GPU's own passes (layout inference: the slabs' tiled views, the
    transposed operands, the four paths' nested conds, the phases' shared buffers) at K = 128
    (two key slabs, ~90 s)."""
    K, V = 128, 64
    s = jax.ShapeDtypeStruct
    Tp, bf, f32 = NC * C, jnp.bfloat16, jnp.float32
    tok = lambda d, dtype=bf: s((B, Tp, H, d), dtype)  # noqa: E731
    seq = lambda d: s((B, H, Tp, d), bf)  # noqa: E731
    args = (tok(K), tok(K), tok(K), tok(V), s((B, Tp, H), f32), tok(K, f32), seq(C), seq(K),
            seq(V), seq(K), seq(K), seq(C), s((B, H, NC, K), f32))
    fn = lambda *a: wy_vector_pullback_mosaic.wy_vector_bwd(*a, interpret=False)  # noqa: E731
    assert mosaic_kernels_lowered_for_cuda(fn, args) == 1


def test_options_name_the_pullbacks():
    """``Options.vector_pullback`` takes None, "kernel" or "mosaic" and says so otherwise."""
    with pytest.raises(ValueError, match="vector_pullback must be None, 'kernel' or 'mosaic', "
                                         "got 'x'"):
        dr.Options(vector_pullback="x")


def test_kernel_checks_its_arguments(rand):
    """A cotangent of the wrong shape, or rows not in whole chunks: a ValueError naming it (the
    arguments: zeros of ``case``'s shapes and dtypes, the kernels traced, not run)."""
    ins = [jnp.zeros(a.shape, a.dtype) for a in jax.eval_shape(lambda: case(rand, 64, 64)[0])]
    bwd = functools.partial(wy_vector_pullback_mosaic.wy_vector_bwd, interpret=True)
    with pytest.raises(ValueError, match="dP must have shape"):
        bwd(*ins[:11], ins[11][..., :32], ins[12])
    with pytest.raises(ValueError, match="Tp must be a multiple of 64, got 100"):
        bwd(*(x[:, :100] for x in ins[:6]), *ins[6:])
