"""The state passes that apply T themselves (pallas_kernels/state_wy_mosaic.py) against
``state_mosaic``'s passes fed with the WY tensors of the same T (interpret mode), and their
lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import state_mosaic, state_wy_mosaic
from pallas_kernels.state_wy_mosaic import BETA, BETA_GAMMA, GAMMA, TAIL, row_vectors
from pallas_kernels.triton_common import Dots
from pallas_kernels.wy_triton import wy_inverse
from precond_linattn.chunked.delta import decay_sums
from conftest import mosaic_kernels_lowered_for_cuda
from test_pallas_precision import rel_rms

B, H, NC, C, V = 2, 2, 3, 64, 128
TP, BF16, F32 = NC * C, jnp.bfloat16, jnp.float32
SCALE = 0.3
# row 0: a document of 2 chunks, then one of 1; row 1: one document of 3
FLAGS = tuple(jnp.asarray(x, jnp.int32) for x in (
    [[0, 0, 1], [2, 2, 2]], [[1, 0, 1], [1, 0, 0]], [[0, 1, 1], [0, 0, 1]]))


def inputs(rand, K):
    """Kernel-layout bf16 q, k, k̃ [B, Tp, H, K], v [B, Tp, H, V], β and log decays g [B, Tp, H]
    (per-chunk decays down to ~0.2: Γ, βΓ and Γ_C/Γ far apart), their T, P, Γ_C
    (``wy_inverse``) and row vectors."""
    x = rand.delta_inputs(B, TP, H, K, V, decay="scalar", dtype=BF16)
    g = 3 * x["log_decay"].astype(F32)
    gamma, sigma = (s.reshape(B, TP, H) for s in decay_sums(g.reshape(B, NC, C, H), 2))
    P, gc, T = wy_inverse(x["q"], x["k"], x["write_key"], x["beta"], g, chunk=C,
                          dots=Dots("tf32x3", interpret=True), num_warps=4, num_stages=1,
                          out_dtype=BF16, t_dtype=BF16)
    return dict(T=T, k=x["k"], kw=x["write_key"], v=x["v"], q=x["q"], P=P,
                vecs=row_vectors(x["beta"], gamma, sigma), gc=gc)


def wy_tensors(x):
    """W, U, K̃', Q' [B, H, Tp, ·] (bf16) of ``x``'s T and inputs, formed in float32:
    T Diag(βΓ) K, T Diag(β) V, Diag(Γ_C/Γ) K̃, Diag(Γ) Q."""
    def row(r):
        return x["vecs"][:, :, r, :, None]

    def heads(a):
        return jnp.swapaxes(a, 1, 2).astype(F32)

    T = x["T"].astype(F32).reshape(B, H, NC, C, C)

    def apply(a):
        return jnp.einsum("bhnij,bhnjd->bhnid", T, a.reshape(B, H, NC, C, -1),
                          precision="highest").reshape(B, H, TP, -1)

    wy = (apply(row(BETA_GAMMA) * heads(x["k"])), apply(row(BETA) * heads(x["v"])),
          row(TAIL) * heads(x["kw"]), row(GAMMA) * heads(x["q"]))
    return tuple(a.astype(BF16) for a in wy)


def assert_close(got, want, names):
    """Relative RMS error <= 1e-2 (bf16 operands rounded at other points of the same algebra: the WY
    tensors once when stored against Y, R Diag(Γ_C/Γ), dRᵀ T Diag(βΓ) here)."""
    for a, b, name in zip(got, want, names):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert bool(jnp.all(jnp.isfinite(a.astype(F32)))), name
        assert rel_rms(a, b) <= 1e-2, (name, rel_rms(a, b))


@pytest.mark.parametrize("K", [64, 128])
def test_forward_pass_matches_the_wy_pass(rand, K):
    """Chunk states, R, final document states (from initial ones) and outputs as
    ``state_mosaic.state_fwd`` gives from W, U, K̃', Q' of the same T."""
    x = inputs(rand, K)
    init = rand.normal(3, H, K, V)
    got = state_wy_mosaic.state_fwd(*x.values(), init, *FLAGS, scale=SCALE, out_dtype=BF16,
                                    num_docs=3, interpret=True)
    W, U, kwt, qd = wy_tensors(x)
    want = state_mosaic.state_fwd(W, U, kwt, x["gc"], init, *FLAGS, num_docs=3, interpret=True,
                                  output=(qd, x["P"], SCALE, BF16))
    assert_close(got, want, ("states", "R", "final", "o"))


@pytest.mark.parametrize("K", [64, 128])
def test_backward_pass_matches_the_wy_pass(rand, K):
    """dR, the chunk-end cotangents and dS_0 as ``state_mosaic.state_bwd`` gives from W, K̃',
    Q' of the same T (its G formed in the pass from dO, as here)."""
    x = inputs(rand, K)
    A = rand.normal(B, H, TP, V, dtype=BF16)
    do = rand.normal(B, TP, H, V, dtype=BF16)
    dfinal = rand.normal(3, H, K, V)
    got = state_wy_mosaic.state_bwd(x["T"], x["k"], x["kw"], x["q"], x["vecs"], x["gc"], A, do,
                                    dfinal, *FLAGS, scale=SCALE, interpret=True)
    W, _, kwt, qd = wy_tensors(x)
    want = state_mosaic.state_bwd(W, kwt, x["gc"], A, None, dfinal, *FLAGS, interpret=True,
                                  products=(qd, do, SCALE))
    assert_close(got, want, ("dR", "dS_C", "dS_0"))


def test_passes_lower_for_cuda():
    """Both passes through Mosaic GPU's own passes (layout inference) at K = V = 128."""
    K = 128
    s = jax.ShapeDtypeStruct
    tok = lambda d: s((B, TP, H, d), BF16)  # noqa: E731
    rows = lambda d: s((B, H, TP, d), BF16)  # noqa: E731
    common = dict(T=rows(C), k=tok(K), kw=tok(K))
    flags = tuple(s(f.shape, jnp.int32) for f in FLAGS)
    vecs, gc = s((B, H, 4, TP), F32), s((B, H, NC, K), F32)
    fwd = lambda T, k, kw, v, q, P, vecs, gc, *fl: state_wy_mosaic.state_fwd(  # noqa: E731
        T, k, kw, v, q, P, vecs, gc, None, *fl, scale=SCALE, out_dtype=BF16, num_docs=None,
        interpret=False)
    assert mosaic_kernels_lowered_for_cuda(
        fwd, (*common.values(), tok(V), tok(K), rows(C), vecs, gc, *flags)) == 1
    bwd = lambda T, k, kw, q, vecs, gc, A, do, df, *fl: state_wy_mosaic.state_bwd(  # noqa: E731
        T, k, kw, q, vecs, gc, A, do, df, *fl, scale=SCALE, interpret=False)
    assert mosaic_kernels_lowered_for_cuda(
        bwd, (*common.values(), tok(K), vecs, gc, rows(V), tok(V), s((B, H, K, V), F32),
              *flags)) == 1


def test_row_vectors():
    """β, βΓ, Γ, Γ_C/Γ by rows, [B, H, 4, Tp], from [B, Tp, H] inputs."""
    beta = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (1, 3, 2)), F32)
    gamma, sigma = -beta, -2 * beta
    got = row_vectors(beta, gamma, sigma)
    assert got.shape == (1, 2, 4, 3)
    want = np.stack([beta, beta * np.exp(gamma), np.exp(gamma), np.exp(sigma)], axis=1)
    np.testing.assert_allclose(got, np.transpose(want, (0, 3, 1, 2)), rtol=1e-6)
