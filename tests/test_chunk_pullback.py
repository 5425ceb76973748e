"""pallas_kernels.chunk_pullback (the recompute form of the delta core's chunk, the rung-2
kernels' specification) against the token-by-token reference and ``jax.vjp``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from pallas_kernels.chunk_pullback import chunk_forward, chunk_pullback
from precond_linattn.reference.delta import delta_rule_reference

C, K, V, SCALE = 16, 8, 12, 0.35


def inputs(seed, t, decay):
    """One row of T = t tokens: unit q and k, k̃ = d ⊙ k with d in [0.5, 2], β in (0.05, 0.95),
    g = log σ(x + 2) (a decay within ~[0.5, 1] a token) or None; a random initial state."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    k = unit(rng.standard_normal((t, K)))
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return dict(q=f(unit(rng.standard_normal((t, K)))), k=f(k),
                kw=f(k * rng.uniform(0.5, 2.0, (t, K))), v=f(rng.standard_normal((t, V))),
                beta=f(rng.uniform(0.05, 0.95, t)),
                g=f(np.log(1 / (1 + np.exp(-rng.standard_normal(t) - 2)))) if decay else None,
                S=f(rng.standard_normal((K, V))))


def by_chunks(x):
    """(outputs [T, V], final state) of one row by ``chunk_forward`` chunk after chunk."""
    S, outs = x["S"], []
    for c in range(x["k"].shape[0] // C):
        rows = slice(c * C, (c + 1) * C)
        o, S = chunk_forward(*(None if x[n] is None else x[n][rows]
                               for n in ("q", "k", "kw", "v", "beta", "g")), S, SCALE)
        outs.append(o)
    return jnp.concatenate(outs), S


def reference(x):
    """The token-by-token reference on the same row (B = H = 1)."""
    row = lambda a: None if a is None else a[None, :, None]  # noqa: E731
    o, final = delta_rule_reference(*(row(x[n]) for n in ("q", "k", "kw", "v", "beta", "g")),
                                    SCALE, x["S"][None, None], None)
    return o[0, :, 0], final[0, 0]


@pytest.mark.parametrize("decay", [False, True])
def test_chunks_match_the_reference(decay):
    """Three chunks of 16: outputs and final state within 1e-5 of the token recurrence."""
    x = inputs(0, 3 * C, decay)
    for got, want, name in zip(by_chunks(x), reference(x), ("o", "final")):
        assert_close(got, want, 1e-5, name)


@pytest.mark.parametrize("decay", [False, True])
def test_pullback_matches_vjp(decay):
    """One chunk: every cotangent of ``chunk_pullback`` within 1e-5 of ``jax.vjp`` of
    ``chunk_forward`` (random dO and dS')."""
    x = inputs(1, C, decay)
    names = ("q", "k", "kw", "v", "beta") + (("g",) if decay else ())
    rng = np.random.default_rng(2)
    do, dS_end = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((C, V), (K, V)))

    def f(*args):
        ins = dict(zip(names + ("S",), args))
        return chunk_forward(*(ins.get(n) for n in ("q", "k", "kw", "v", "beta", "g")),
                             ins["S"], SCALE)

    _, vjp = jax.vjp(f, *(x[n] for n in names + ("S",)))
    want = vjp((do, dS_end))
    dq, dk, dkw, dv, dbeta, dg, dS = chunk_pullback(
        *(x[n] for n in ("q", "k", "kw", "v", "beta", "g", "S")), do, dS_end, SCALE)
    got = (dq, dk, dkw, dv, dbeta) + ((dg,) if decay else ()) + (dS,)
    for a, b, name in zip(got, want, names + ("S",)):
        assert_close(a, b, 1e-5, f"d{name}")
    assert (dg is None) == (not decay)


@pytest.mark.parametrize("decay", [False, True])
def test_recompute_backward_over_a_row(decay):
    """The rung-2 backward over three chunks: chunk-start states recomputed forward, dS carried
    from the last chunk to the first, each chunk's cotangents from ``chunk_pullback`` alone:
    every gradient (q, k, k̃, v, β, g and the initial state) within 1e-5 of the reference's."""
    x = inputs(3, 3 * C, decay)
    names = ("q", "k", "kw", "v", "beta") + (("g",) if decay else ()) + ("S",)
    rng = np.random.default_rng(4)
    do, dfinal = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3 * C, V), (K, V)))

    def loss(*args):
        o, final = reference({**x, **dict(zip(names, args))})
        return jnp.sum(o * do) + jnp.sum(final * dfinal)

    want = jax.grad(loss, argnums=tuple(range(len(names))))(*(x[n] for n in names))
    chunks = [dict((n, None if x[n] is None else x[n][c * C:(c + 1) * C])
                   for n in ("q", "k", "kw", "v", "beta", "g")) for c in range(3)]
    starts, S = [], x["S"]
    for ch in chunks:
        starts.append(S)
        S = chunk_forward(*ch.values(), S, SCALE)[1]
    grads, dS = [], dfinal
    for c in reversed(range(3)):
        *g, dS = chunk_pullback(*chunks[c].values(), starts[c], do[c * C:(c + 1) * C], dS, SCALE)
        grads.insert(0, g)
    got = [jnp.concatenate([g[i] for g in grads]) for i in range(5 + decay)] + [dS]
    for a, b, name in zip(got, want, names):
        assert_close(a, b, 1e-5, f"d{name}")
