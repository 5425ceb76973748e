"""The Mosaic WY inverse (pallas_kernels/inverse_mosaic.py) against float64 and against the
Triton ``wy_inverse`` (interpret mode), and its lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import delta_rule, inverse_mosaic
from pallas_kernels.delta_rule import Options, delta_rule_pallas
from pallas_kernels.triton_common import Dots, unit_lower_inverse
from pallas_kernels.wy_triton import wy_inverse
from precond_linattn.chunked.delta import decay_sums
from conftest import mosaic_kernels_lowered_for_cuda
from test_pallas_precision import assert_within_fla_bars, kernel_runs, rel_rms

B, H, NC, C = 1, 2, 2, 64
TP, BF16, F32 = NC * C, jnp.bfloat16, jnp.float32


def inputs(rand, K, similar):
    """bf16 q, k, k̃ [B, Tp, H, K], β and log decays g [B, Tp, H] (down to ~0.2 a chunk); with
    ``similar`` the keys share a direction (mean cosine ~0.7 at 1.5), where (I + L)^-1 is
    ill-conditioned."""
    x = rand.delta_inputs(B, TP, H, K, 16, decay="scalar", dtype=F32)
    shared = rand.normal(K)
    k, kw = (x[n] + similar * shared for n in ("k", "write_key"))
    k, kw = (a / jnp.linalg.norm(a, axis=-1, keepdims=True) for a in (k, kw))
    return (x["q"].astype(BF16), k.astype(BF16), kw.astype(BF16), x["beta"],
            3 * x["log_decay"].astype(F32))


def float64_inverse(q, k, kw, beta, g):
    """T [B, H, Tp, C] and P of the bf16 inputs in float64 (numpy)."""
    f = lambda a: np.asarray(a, np.float64).reshape(B, NC, C, H, -1).transpose(0, 3, 1, 2, 4)  # noqa: E731
    q, k, kw, beta, g = (f(a) for a in (q, k, kw, beta, g))
    gamma = np.cumsum(g[..., 0], axis=-1)
    i, j = np.arange(C)[:, None], np.arange(C)[None, :]
    D = np.where(i >= j, np.exp(np.where(i >= j, gamma[..., :, None] - gamma[..., None, :], 0)), 0)
    L = np.where(i > j, beta * (k @ np.swapaxes(kw, -1, -2)) * D, 0)
    T = np.linalg.inv(np.eye(C) + L)
    P = (q @ np.swapaxes(kw, -1, -2)) * D
    return T.reshape(B, H, TP, C), P.reshape(B, H, TP, C)


class Tf32Dots:
    """``Dots.nn`` as the H200 runs the Triton inverse's "tf32" dots: operands rounded to 10
    mantissa bits (nearest), float32 sums."""

    @staticmethod
    def nn(a, b):
        def tf32(x):
            bits = np.asarray(x, np.float32).view(np.uint32)
            return ((bits + 0x1000) & 0xFFFFE000).view(np.float32)
        return np.matmul(tf32(a), tf32(b))


def bits_as_float64(T, T64):
    """The fraction of T's elements that round to bf16 as float64's T does."""
    bf16 = lambda x: np.asarray(jnp.asarray(x, BF16), np.float32)  # noqa: E731
    return float(np.mean(bf16(T) == bf16(T64)))


@pytest.mark.parametrize("K, similar", [(64, 0.0), (128, 1.5)])
def test_inverse_matches_float64_and_the_triton_kernel(rand, K, similar):
    """T − I and P within bf16 storage rounding of float64 (relative RMS <= 2e-3, also with keys
    sharing a direction), the float32 outputs (Γ_C, the row vectors) equal to the Triton
    ``wy_inverse``'s to float rounding, T, P as close to float64 as the Triton kernel's (exact
    float32 dots in interpret mode), and T's merges at least as accurate as tf32 dots. With
    fewer bf16 passes a merge product (``passes`` 2, 1) T's merges are coarser (fewer elements
    round to float64's bf16 bits, fewest with one) but T within 1.1x the three passes' RMS
    error: T's bf16 storage dominates them all."""
    ins = inputs(rand, K, similar)
    q, k, kw, beta, g = ins
    sums = [x.reshape(g.shape) for x in decay_sums(g.reshape(B, NC, C, H), 2)]  # γ, σ
    run = jax.jit(lambda *a, passes: inverse_mosaic.wy_inverse(*a, interpret=True, passes=passes),
                  static_argnames="passes")
    P, gc, T, vecs = run(q, k, kw, beta, *sums, passes=3)
    P3, gc3, T3, vecs3 = wy_inverse(*ins, chunk=C, dots=Dots("tf32x3", interpret=True),
                                    num_warps=4, num_stages=1, out_dtype=BF16, t_dtype=BF16)
    T64, P64 = float64_inverse(*ins)
    eye = np.eye(C)[None, None].repeat(NC, 0).reshape(TP, C)  # T's exact diagonal left out
    for got, triton, want, name in ((T, T3, T64, "T"), (P, P3, P64, "P")):
        assert got.dtype == BF16 and got.shape == want.shape, name
        drop = eye if name == "T" else 0.0
        got, triton, want = (np.asarray(a, np.float64) - drop for a in (got, triton, want))
        assert rel_rms(got, want) <= 2e-3, (name, rel_rms(got, want))
        assert rel_rms(got, want) <= 1.1 * rel_rms(triton, want), name
    np.testing.assert_allclose(gc, gc3, rtol=1e-6)
    np.testing.assert_allclose(vecs, vecs3, rtol=2e-6, atol=1e-7)
    # the merges' own accuracy: T rounds to float64's bf16 bits at least as often as with the
    # device Triton kernel's tf32 dots (emulated), whose error the bf16 storage hides less
    L = np.linalg.inv(T64.reshape(B, H, NC, C, C)) - np.eye(C)
    tf32 = unit_lower_inverse(np.where(np.tril(np.ones((C, C)), -1) > 0, L, 0).astype(np.float32),
                              Tf32Dots).reshape(T64.shape)
    assert bits_as_float64(T, T64) >= bits_as_float64(tf32, T64)
    bits, err = [bits_as_float64(T, T64)], lambda a: rel_rms(np.asarray(a, np.float64) - eye,
                                                             T64 - eye)  # noqa: E731
    for passes in (2, 1):
        Pn, _, Tn, _ = run(q, k, kw, beta, *sums, passes=passes)
        np.testing.assert_array_equal(np.asarray(Pn, F32), np.asarray(P, F32))
        bits.append(bits_as_float64(Tn, T64))
        assert err(Tn) <= 1.1 * err(T), (passes, err(Tn), err(T))
    assert bits[0] > bits[1] > bits[2], bits


def test_chunks_per_cta_change_nothing(rand):
    """A CTA walking both chunks of a row (the next chunk's loads in flight) gives the bits of
    one CTA a chunk; a count that does not divide the chunks is refused."""
    q, k, kw, beta, g = inputs(rand, 64, 0.5)
    heads = lambda x: jnp.moveaxis(x, 2, 1)  # noqa: E731
    gamma = heads(decay_sums(g.reshape(B, NC, C, H), 2)[0].reshape(g.shape))
    run = lambda n: inverse_mosaic.inverse(q, k, kw, heads(beta), gamma, interpret=True,  # noqa: E731
                                           chunks=n)
    for one, two in zip(run(1), run(2)):
        np.testing.assert_array_equal(np.asarray(one, F32), np.asarray(two, F32))
    with pytest.raises(ValueError, match="chunks"):
        run(4)
    assert inverse_mosaic.chunks_per_cta(8, 8, 32) == 8
    assert inverse_mosaic.chunks_per_cta(1, 8, 32) == 1


@pytest.mark.parametrize("chunks, passes", [(1, 3), (2, 2), (1, 1)])
def test_inverse_lowers_for_cuda(chunks, passes):
    """Through Mosaic GPU's own passes (layout inference; the substitution's ``inline_mgpu``
    block) at K = 128, one chunk a CTA and two, each count of bf16 passes a merge product."""
    s = jax.ShapeDtypeStruct
    tok, rows = s((B, TP, H, 128), BF16), s((B, H, TP), F32)
    fn = lambda *a: inverse_mosaic.inverse(*a, interpret=False, chunks=chunks,  # noqa: E731
                                         passes=passes)
    assert mosaic_kernels_lowered_for_cuda(fn, (tok, tok, tok, rows, rows)) == 1


MOSAIC_INVERSE_KW = dict(serial_backend="mosaic", fused_grads=True, inverse_backend="mosaic")


@pytest.mark.parametrize("decay, p_in_serial", [(None, None), ("scalar", None),
                                                ("scalar", False)])
def test_op_within_fla_bars(rand, decay, p_in_serial, monkeypatch):
    """The op with ``inverse_backend="mosaic"`` (T = 150, K = 40 and V = 48 padded to 64, an
    initial state), P formed by the state passes (the default) or by the inverse: outputs,
    final state and every gradient within FLA's bars of the float32 reference and no more than
    1.25x as far from it as with the Triton inverse; the kernel was traced for the forward only
    (twice: in the op's own jaxpr under ``partition.lowered_once``'s jit, and in its VJP's
    forward), with q only where it forms P: the backward reuses T."""
    calls = []
    real = inverse_mosaic.inverse
    monkeypatch.setattr(inverse_mosaic, "inverse",
                        lambda q, *a, **kw: calls.append(q is not None) or real(q, *a, **kw))
    triton = Options(serial_backend="mosaic", fused_grads=True, inverse_backend="triton")
    options = Options(p_in_serial=p_in_serial, **MOSAIC_INVERSE_KW)
    mosaic, base, ref = kernel_runs(rand, decay, 7, options, triton, K=40)
    assert calls == [p_in_serial is False] * 2
    assert_within_fla_bars(mosaic, ref)
    pairs = [(mosaic[0], base[0], ref[0]), (mosaic[1], base[1], ref[1])]
    pairs += [(mosaic[2][n], base[2][n], ref[2][n]) for n in ref[2]]
    for a, b, want in pairs:
        assert rel_rms(a, want) <= 1.25 * rel_rms(b, want)


def test_inverse_passes_reach_the_kernel(rand, monkeypatch):
    """``Options.inverse_passes`` reaches the Mosaic inverse (None: two); other counts are
    refused by Options and by the kernel."""
    x = rand.delta_inputs(1, 64, 1, 64, 64, dtype=BF16)
    seen = []
    real = inverse_mosaic.inverse
    monkeypatch.setattr(inverse_mosaic, "inverse",
                        lambda *a, **kw: seen.append(kw["passes"]) or real(*a, **kw))
    for passes in (None, 3, 1):
        jax.eval_shape(lambda x: delta_rule_pallas(
            x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 0.125, None, None, 64,
            Options(inverse_passes=passes, **MOSAIC_INVERSE_KW)), x)
        seen.append("|")
    assert "".join(map(str, seen)) in ("2|3|1|", "22|33|11|"), seen
    with pytest.raises(ValueError, match="inverse_passes must be None, 1, 2 or 3"):
        Options(inverse_passes=4)
    with pytest.raises(ValueError, match="passes must be 1, 2 or 3"):
        inverse_mosaic.unit_lower_inverse(None, None, None, None, None, True, passes=0)


def test_needs_wy_in_serial(rand, monkeypatch):
    """``inverse_backend="mosaic"`` where the passes do not apply T (no fused_grads): a
    ValueError naming what it needs; an unknown backend: one naming the choices; None: "mosaic"
    with ``wy_in_serial``, else "triton"."""
    x = rand.delta_inputs(1, 64, 1, 64, 64, dtype=BF16)
    with pytest.raises(ValueError, match="inverse_backend='mosaic' needs wy_in_serial"):
        delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 0.125, None,
                          None, 64, Options(serial_backend="mosaic", fused_grads=False,
                                            inverse_backend="mosaic"))
    with pytest.raises(ValueError, match="inverse_backend must be"):
        Options(inverse_backend="cuda")
    seen = []
    real = delta_rule._core
    monkeypatch.setattr(delta_rule, "_core",
                        lambda cfg, *a: seen.append(cfg.options.inverse_backend) or real(cfg, *a))
    for fused in (True, False):
        delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 0.125, None,
                          None, 64, Options(serial_backend="mosaic", fused_grads=fused))
    assert seen == ["mosaic", "triton"]
