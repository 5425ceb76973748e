"""The in-chunk sums of per-channel log decays as Mosaic GPU kernels (``decay_scan_mosaic``,
``Options.decay_scan="mosaic"``) in interpret mode: each sum against the same sum taken token by
token in float32 (the kernels' order: bit for bit), the op end to end against XLA's sums and the
token-by-token reference, the CUDA lowering, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mosaic_kernels_lowered_for_cuda, packed_cu_seqlens, rel_err
from test_pallas_precision import packed_runs

from pallas_kernels import decay_scan_mosaic as scan
from pallas_kernels.delta_rule import Options, delta_rule_pallas


def walked(x, chunk, reverse=False, exclusive=False):
    """Σ over each chunk's tokens up to t (from t on if ``reverse``; strictly before t if
    ``exclusive``), added one token at a time in float32: the kernels' order."""
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    for c0 in range(0, x.shape[1], chunk):
        acc = np.zeros_like(x[:, 0])
        order = range(c0 + chunk - 1, c0 - 1, -1) if reverse else range(c0, c0 + chunk)
        for t in order:
            if exclusive:
                out[:, t] = acc
                acc = acc + x[:, t]
            else:
                acc = acc + x[:, t]
                out[:, t] = acc
    return out


@pytest.mark.parametrize("shape, chunk", [((2, 48, 2, 64), 16), ((1, 128, 1, 128), 64)])
def test_kernels_sum_token_by_token(rand, shape, chunk):
    """γ = the in-chunk cumsum and dg = suffix sums of dγ + exclusive prefix sums of dσ, each
    bit for bit the float32 sums taken token by token; 2 x 64 channels in one CTA's 128."""
    g = jnp.asarray(-rand.rng.uniform(0.01, 3.0, shape), jnp.float32)
    dgamma, dsigma = rand.normal(*shape), rand.normal(*shape)
    np.testing.assert_array_equal(scan.decay_cumsum(g, chunk, interpret=True), walked(g, chunk))
    want = walked(dgamma, chunk, reverse=True) + walked(dsigma, chunk, exclusive=True)
    np.testing.assert_array_equal(scan.decay_sums_pullback(dgamma, dsigma, chunk, interpret=True),
                                  want)


def test_op_with_the_kernels_matches_xla_sums(rand):
    """KDA through ``delta_rule_pallas`` (float32, chunk 16, three packed documents of 30, 1 and
    39 tokens: document boundaries inside chunks and a padded last chunk; K = 64 with 2 heads;
    an initial state per document) with ``decay_scan="mosaic"``: outputs, final states and
    every gradient but dg bitwise those of XLA's sums (γ is the same cumsum), dg within 1e-6
    (its sums in another order), and all of them within 1e-4 of the float32 token-by-token
    reference. (Batch rows: ``test_kernels_sum_token_by_token``.)"""
    B, T, H, K, V = 1, 70, 2, 64, 48
    x = rand.delta_inputs(B, T, H, K, V, decay="vector")
    x["s0"] = rand.normal(3, H, K, V)
    mosaic, xla, ref = packed_runs(x, packed_cu_seqlens([30, 1, 39]), 16,
                                   Options(decay_scan="mosaic"), Options(decay_scan="xla"))
    for a, b in zip(mosaic[:2], xla[:2]):
        np.testing.assert_array_equal(a, b)
    for name in ref[2]:
        if name == "log_decay":
            assert 0 < rel_err(mosaic[2][name], xla[2][name]) <= 1e-6
        else:
            np.testing.assert_array_equal(mosaic[2][name], xla[2][name], err_msg=name)
    for got, want in zip(mosaic[:2], ref[:2]):
        assert rel_err(got, want) <= 1e-4
    for name in ref[2]:
        assert rel_err(mosaic[2][name], ref[2][name]) <= 1e-4, name


def test_kernels_lower_for_cuda():
    """Both kernels go through Mosaic GPU's lowering for CUDA on the CPU (its layout inference
    runs; interpret mode skips it)."""
    x = jax.ShapeDtypeStruct((2, 128, 2, 128), jnp.float32)
    assert mosaic_kernels_lowered_for_cuda(
        lambda g: scan.decay_cumsum(g, 64, interpret=False), [x]) == 1
    assert mosaic_kernels_lowered_for_cuda(
        lambda a, b: scan.decay_sums_pullback(a, b, 64, interpret=False), [x, x]) == 1


def test_errors_name_the_argument(rand):
    """A bad ``decay_scan``, the kernels asked for where H K is not a multiple of 128, and
    shapes the kernels cannot take each raise a ValueError saying what was expected."""
    with pytest.raises(ValueError, match="decay_scan must be None, 'xla' or 'mosaic'"):
        Options(decay_scan="triton")
    x = rand.delta_inputs(1, 32, 3, 64, 32, decay="vector")
    with pytest.raises(ValueError, match="decay_scan='mosaic' needs H\\*K a multiple of 128"):
        delta_rule_pallas(x["q"], x["k"], x["write_key"], x["v"], x["beta"], x["log_decay"],
                          0.125, None, None, 16, Options(decay_scan="mosaic"))
    g = jnp.zeros((1, 48, 1, 96), jnp.float32)
    with pytest.raises(ValueError, match="H\\*K a multiple of 128"):
        scan.decay_cumsum(g, 16, interpret=True)
    with pytest.raises(ValueError, match="dsigma must have dgamma's shape"):
        scan.decay_sums_pullback(jnp.zeros((1, 32, 1, 128)), jnp.zeros((1, 32, 2, 64)), 16,
                                 interpret=True)
