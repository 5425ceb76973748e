"""Bad arguments to the delta-rule op raise a ValueError naming the argument."""

import jax
import jax.numpy as jnp
import pytest

import precond_linattn as pla

B, T, H, K, V = 1, 12, 2, 8, 4


@pytest.fixture
def args(rand):
    return dict(q=rand.unit(B, T, H, K), k=rand.unit(B, T, H, K), v=rand.normal(B, T, H, V),
                beta=rand.beta(B, T, H))


def call(args, **kw):
    return pla.delta_rule(args["q"], args["k"], args["v"], args["beta"], impl="chunked", **kw)


@pytest.mark.parametrize("name, bad, match", [
    ("q", lambda a: a["q"][0], r"q must have shape \[B, T, H, K\]"),
    ("k", lambda a: a["k"][:, :, :, :4], r"k must have shape"),
    ("v", lambda a: a["v"][:, :5], r"v must have shape"),
    ("beta", lambda a: a["beta"][..., None], r"beta must have shape \[B, T, HV\]"),
    ("q", lambda a: a["q"].astype(jnp.int32), r"q has unsupported dtype int32"),
])
def test_bad_tensor(args, name, bad, match):
    args = dict(args, **{name: bad(args)})
    with pytest.raises(ValueError, match=match):
        call(args)


def test_bad_keywords(args, rand):
    with pytest.raises(ValueError, match="write_key must have shape"):
        call(args, write_key=rand.unit(B, T, H, K + 1))
    with pytest.raises(ValueError, match="log_decay must be None"):
        call(args, log_decay=rand.normal(B, T))
    with pytest.raises(ValueError, match=r"log_decay must have shape \[B, T, HV, K\]"):
        call(args, log_decay=rand.normal(B, T, H, K + 1))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\]"):
        call(args, initial_state=rand.normal(B, H, V, K))
    with pytest.raises(ValueError, match="impl must be one of"):
        pla.delta_rule(args["q"], args["k"], args["v"], args["beta"], impl="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        call(args, chunk_size=0)
    with pytest.raises(ValueError, match="scale must be a finite scalar"):
        call(args, scale=float("nan"))


@pytest.mark.parametrize("cu, match", [
    ([0, 5, 5, 12], "strictly increasing"),
    ([0, 7, 5, 12], "strictly increasing"),
    ([1, 5, 12], "must start at 0"),
    ([0, 5, 11], "must end at T=12"),
    ([[0, 12]], "1-D integer array"),
])
def test_bad_cu_seqlens(args, cu, match):
    with pytest.raises(ValueError, match=match):
        call(args, cu_seqlens=jnp.asarray(cu, jnp.int32))


def test_cu_seqlens_needs_batch_one(rand):
    q = rand.unit(2, T, H, K)
    with pytest.raises(ValueError, match="cu_seqlens requires batch size 1"):
        pla.delta_rule(q, q, rand.normal(2, T, H, V), rand.beta(2, T, H),
                       cu_seqlens=jnp.asarray([0, 12], jnp.int32))
    with pytest.raises(ValueError, match="cu_seqlens must have an integer dtype"):
        pla.delta_rule(q[:1], q[:1], rand.normal(1, T, H, V), rand.beta(1, T, H),
                       cu_seqlens=jnp.asarray([0.0, 12.0]))


def test_step_errors(rand):
    q = rand.unit(B, H, K)
    S = jnp.zeros((B, H, K, V))
    with pytest.raises(ValueError, match=r"state must have shape \[B, HV, K, V\]"):
        pla.delta_rule_step(q, q, rand.normal(B, H, V), rand.beta(B, H), S[..., :2])
    with pytest.raises(ValueError, match="log_decay must be None"):
        pla.delta_rule_step(q, q, rand.normal(B, H, V), rand.beta(B, H), S,
                            log_decay=rand.normal(B, H, K, 1))
    jax.block_until_ready(pla.delta_rule_step(q, q, rand.normal(B, H, V), rand.beta(B, H), S))


def test_pallas_without_a_kernel_is_a_clear_error():
    from precond_linattn.ops.dispatch import choose_impl

    with pytest.raises(ValueError, match="impl='pallas' is not available for no_such_op"):
        choose_impl("no_such_op", "pallas")
    assert choose_impl("no_such_op", "auto") == "chunked"
