"""The Mosaic GPU kernels of the ATK phase (pallas_kernels/atk_mosaic.py, ``Options(mosaic=True)``:
16-bit keys with a per-head decay at K padded to 128) against the token-by-token reference in
interpret mode, where they apply and where they fall back, and their lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond_linattn as pla
from benchmarks.mosaic_barriers import barriers, modules
from conftest import assert_close, triton_kernels_lowered_for_cuda
from pallas_kernels import atk_precond
from test_pallas_atk import make_inputs

F32 = jnp.float32


def triton_refused(monkeypatch):
    """The Triton kernels raise if called (so results show that the Mosaic ones ran)."""
    def refuse(*a, **kw):
        raise AssertionError("a Triton ATK kernel was called")
    monkeypatch.setattr(atk_precond, "atk_fwd", refuse)
    monkeypatch.setattr(atk_precond, "atk_bwd", refuse)


MOSAIC = atk_precond.Options(mosaic=True)
PAIR = atk_precond.Options(mosaic=True, mosaic_warpgroups=2)


def precondition(impl, x, cu_seqlens=None, options=MOSAIC):
    """(k̃, final A) of the reference (impl "reference") or of the kernels with ``options``."""
    if impl == "reference":
        return pla.atk_precondition(x["k"], x["log_decay"], x["gain"], x["center"], x=1.5,
                                    initial_state=x["initial_state"], output_final_state=True,
                                    cu_seqlens=cu_seqlens, impl="reference")
    return atk_precond.atk_pallas(x["k"], x["log_decay"], x["gain"], x["center"], 1.5, 1e-6,
                                  x["initial_state"], cu_seqlens, 64, options)


def run(impl, x, cu_seqlens=None, options=MOSAIC):
    """(k̃, final A, gradients of every input) for a loss linear in k̃ and the final state with
    weights exact in bf16 (so the kernels' bf16 cotangent of k̃ is the reference's)."""
    kw_weight = jax.random.normal(jax.random.PRNGKey(5), x["k"].shape).astype(jnp.bfloat16)
    final_weight = jax.random.normal(jax.random.PRNGKey(6), x["initial_state"].shape)

    def loss(x):
        kw, final = precondition(impl, x, cu_seqlens, options)
        value = jnp.sum(kw.astype(F32) * kw_weight.astype(F32)) + jnp.sum(final * final_weight)
        return value, (kw, final)

    (_, (kw, final)), grads = jax.value_and_grad(loss, has_aux=True)(x)
    return kw, final, grads


def assert_matches_reference(x, cu_seqlens=None, options=MOSAIC):
    """bf16 keys on the kernels, the same values in float32 through the reference: k̃ and ∂k
    (bf16 results) within bf16's rounding, everything else within 2e-5."""
    got = run("pallas", x, cu_seqlens, options)
    want = run("reference", dict(x, k=x["k"].astype(F32)), cu_seqlens)
    assert got[0].dtype == jnp.bfloat16 and got[2]["k"].dtype == jnp.bfloat16
    assert_close(got[0], want[0], 4e-3, "k̃")
    assert_close(got[2]["k"], want[2]["k"], 4e-3, "dk")
    assert_close(got[1], want[1], 2e-5, "final state")
    for name in ("log_decay", "gain", "center", "initial_state"):
        assert_close(got[2][name], want[2][name], 2e-5, f"d{name}")


@pytest.mark.parametrize("options", [MOSAIC, PAIR], ids=["one", "two warpgroups"])
def test_matches_reference(options, monkeypatch):
    """Two rows, two heads, K = 100 padded to 128, T = 150 (a partial last tile), decays with
    some α tiny: forward, final state and every gradient, on one warpgroup and on two."""
    triton_refused(monkeypatch)
    x = make_inputs(3, b=2, t=150, h=2, k_dim=100, dtype=jnp.bfloat16)
    x = dict(x, **{n: x[n].astype(F32) for n in ("log_decay", "gain", "center")})
    assert_matches_reference(x, options=options)


@pytest.mark.parametrize("options", [MOSAIC, PAIR], ids=["one", "two warpgroups"])
def test_packed_documents(options, monkeypatch):
    """One row of documents whose boundaries fall inside tiles (one of a single token), each
    with its initial state: the restarts of A and λ, the final states and their gradients."""
    triton_refused(monkeypatch)
    cu = jnp.asarray([0, 37, 38, 100, 171], jnp.int32)
    x = make_inputs(4, b=1, t=171, h=2, k_dim=128, n_init=4, dtype=jnp.bfloat16)
    x = dict(x, **{n: x[n].astype(F32) for n in ("log_decay", "gain", "center")})
    assert_matches_reference(x, cu, options)


def lowered(k_dtype, g_shape, packed=False):
    """{Mosaic kernel name: module} and the Triton kernel count of the phase's gradient with
    ``MOSAIC`` lowered for CUDA (three tiles; with ``packed`` three documents in one row)."""
    s = jax.ShapeDtypeStruct
    b, t = (1, 170) if packed else (2, 170)
    cu = jnp.asarray([0, 37, 100, t], jnp.int32) if packed else None
    args = [s((b, t, 2, 128), k_dtype), s((b, t, 2) + g_shape, F32), s((b, t, 2), F32),
            s((2,), F32), s((3 if packed else b, 2, 128), F32)]

    def loss(k, g, gain, c, init):
        kw, final = atk_precond.atk_pallas(k, g, gain, c, 1.5, 1e-6, init, cu, 64, MOSAIC,
                                           interpret=False)
        return jnp.sum(kw.astype(F32) ** 2) + jnp.sum(final)

    grad = lambda *a: jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*a)  # noqa: E731
    return modules(grad, args), triton_kernels_lowered_for_cuda(loss, args)


@pytest.mark.parametrize("k_dtype, g_shape", [(jnp.bfloat16, (128,)), (F32, ())])
def test_falls_back_to_triton(k_dtype, g_shape):
    """Per-channel decays and float32 keys take the Triton kernels (whose results the tests of
    test_pallas_atk check), not the Mosaic ones."""
    mosaic, triton = lowered(k_dtype, g_shape)
    assert not mosaic and triton == 2


@pytest.mark.parametrize("packed", [False, True])
def test_lowers_for_cuda(packed):
    """Both kernels through Mosaic GPU's passes; without packed documents no warpgroup barrier
    inside the token loops (depth 2: tiles, tokens); no Triton kernel."""
    found, triton = lowered(jnp.bfloat16, (), packed)
    assert sorted(found) == ["atk_bwd_mosaic", "atk_fwd_mosaic"] and triton == 0
    if not packed:
        assert all(max(barriers(text)) <= 1 for text in found.values()), {
            n: barriers(text) for n, text in found.items()}


def test_vmapped_packed_rows(monkeypatch):
    """As training runs packed documents: rows of one document each under ``jax.vmap``, equal
    to each row alone."""
    triton_refused(monkeypatch)
    x = make_inputs(6, b=2, t=64, h=1, k_dim=128, n_init=2, dtype=jnp.bfloat16)

    def f(k, g, gain, init):
        return atk_precond.atk_pallas(k[None], g[None], gain[None], x["center"].astype(F32), 1.5,
                                      1e-6, init[None], jnp.asarray([0, 64], jnp.int32), 64, MOSAIC)

    args = (x["k"], x["log_decay"].astype(F32), x["gain"].astype(F32), x["initial_state"])
    rows = jax.jit(jax.vmap(f))(*args)
    for i in range(2):
        alone = jax.jit(f)(*(a[i] for a in args))
        for got, want in zip(rows, alone):
            np.testing.assert_allclose(np.asarray(got[i], np.float64),
                                       np.asarray(want, np.float64), rtol=1e-5, atol=1e-6)
