"""Grouped value heads in ``delta_rule`` / ``delta_rule_step`` (more value heads than key heads,
FLA's convention): value head j reads key head j // (HV / H) with its own v, β, decay and
state, so the op equals each value head run alone with its key head; gradients of q, k, k̃ sum
over the group."""

import jax.numpy as jnp
import pytest

import precond_linattn as pla
from conftest import assert_runs_match, fixed_loss_run

B, T, H, HV, K, V = 2, 21, 2, 6, 8, 5  # groups of 3 value heads a key head


def inputs(rand, decay):
    x = rand.delta_inputs(B, T, HV, K, V, decay)
    for name in ("q", "k", "write_key"):  # key-side inputs on H heads
        x[name] = x[name][:, :, :H]
    x["initial_state"] = rand.normal(B, HV, K, V)
    return x


def grouped(impl):
    def f(x):
        return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["write_key"],
                              log_decay=x["log_decay"], initial_state=x["initial_state"],
                              output_final_state=True, impl=impl, chunk_size=16)
    return f


def head_by_head(x):
    """Each value head j alone (one head), with key head j // (HV / H), through the reference."""
    outs, finals = [], []
    for j in range(HV):
        i, v = j // (HV // H), slice(j, j + 1)
        key = {n: x[n][:, :, i:i + 1] for n in ("q", "k", "write_key")}
        decay = None if x["log_decay"] is None else x["log_decay"][:, :, v]
        o, s = pla.delta_rule(key["q"], key["k"], x["v"][:, :, v], x["beta"][:, :, v],
                              write_key=key["write_key"], log_decay=decay,
                              initial_state=x["initial_state"][:, v], output_final_state=True,
                              impl="reference")
        outs.append(o)
        finals.append(s)
    return jnp.concatenate(outs, axis=2), jnp.concatenate(finals, axis=1)


@pytest.mark.parametrize("impl, decay", [("reference", "vector"), ("chunked", None),
                                         ("chunked", "scalar"), ("pallas", "scalar")])
def test_grouped_value_heads_equal_each_head_alone(rand, impl, decay):
    """Outputs, final states and every gradient (q, k, k̃ summed over their groups)."""
    x = inputs(rand, decay)
    got = fixed_loss_run(grouped(impl), x)
    assert got[0].shape == (B, T, HV, V) and got[1].shape == (B, HV, K, V)
    assert_runs_match(got, fixed_loss_run(head_by_head, x), 2e-5,
                      [n for n, a in x.items() if a is not None])


def test_step_with_grouped_value_heads(rand):
    """One decode step: each value head's update with its key head's q, k, k̃."""
    x = inputs(rand, "vector")
    t = 3
    q, k, kw = (x[n][:, t] for n in ("q", "k", "write_key"))
    v, beta, g, S = x["v"][:, t], x["beta"][:, t], x["log_decay"][:, t], x["initial_state"]
    o, S_new = pla.delta_rule_step(q, k, v, beta, S, write_key=kw, log_decay=g)
    rep = lambda a: jnp.repeat(a, HV // H, axis=1)  # noqa: E731
    o_want, S_want = pla.delta_rule_step(rep(q), rep(k), v, beta, S, write_key=rep(kw),
                                         log_decay=g)
    assert jnp.array_equal(o, o_want) and jnp.array_equal(S_new, S_want)
    one = pla.delta_rule_step(q[:, 1:], k[:, 1:], v[:, 3:4], beta[:, 3:4], S[:, 3:4],
                              write_key=kw[:, 1:], log_decay=g[:, 3:4])  # value head 3: key 1
    assert jnp.allclose(o[:, 3:4], one[0], rtol=1e-6) and jnp.allclose(S_new[:, 3:4], one[1],
                                                                        rtol=1e-6)


@pytest.mark.parametrize("heads", [3, 5, 1])
def test_value_heads_not_a_multiple_raise(rand, heads):
    x = inputs(rand, None)
    v = rand.normal(B, T, heads, V)
    with pytest.raises(ValueError, match="multiple of q's H = 2 heads"):
        pla.delta_rule(x["q"], x["k"], v, x["beta"][:, :, :heads])
    with pytest.raises(ValueError, match="multiple of q's H = 2 heads"):
        pla.delta_rule_step(x["q"][:, 0], x["k"][:, 0], v[:, 0], x["beta"][:, 0, :heads],
                            jnp.zeros((B, heads, K, V)))
