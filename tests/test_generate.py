"""Generation with ragged (right-padded) prompts and an end token, on the tiny models of
test_models (CPU, float32 compute, chunked ops, chunk 4).

A ragged prefill leaves each row exactly the cache of its real tokens (all twelve variants); a
ragged batch generates what each row generates alone; EOS pads a row's later tokens and an
all-done batch stops with the output shape unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from precond_linattn.models import LanguageModel, generate
from precond_linattn.models.generate import prefill
from test_models import VARIANTS, VOCAB, step, tiny_model, tokens

T, LENGTHS = 9, (9, 5, 1)  # T not a multiple of the chunk (4); a full row, a ragged one, one token


@nnx.jit
def ragged_prefill(model, prompt, lengths):
    return prefill(model, prompt, lengths)


def check_ragged_prefill(model):
    """Each row's logits and cache == those after its real tokens alone, fed one at a time from
    the empty cache (the decode path, equal to a plain prefill by test_models)."""
    prompt = tokens(5, len(LENGTHS), T)  # the padding holds random tokens, not zeros
    logits, cache = ragged_prefill(model, prompt, jnp.asarray(LENGTHS))
    for b, n in enumerate(LENGTHS):
        row_cache = model.init_cache(1)
        for t in range(n):
            row_logits, row_cache = step(model, prompt[b:b + 1, t], row_cache)
        assert rel_err(logits[b], row_logits[0]) <= 1e-5
        for got, want in zip(jax.tree.leaves(cache.ordered()), jax.tree.leaves(row_cache.ordered()),
                             strict=True):
            assert rel_err(got[b], want[0]) <= 1e-5


@pytest.mark.parametrize("backbone,pre", VARIANTS)
def test_ragged_prefill_equals_each_row_alone(backbone, pre):
    check_ragged_prefill(tiny_model(backbone, pre, num_layers=1))


@pytest.mark.parametrize("backbone,pre", [("gdn", "osgm"), ("kda", "osgm_apf")])
def test_ragged_prefill_on_the_pallas_kernels(backbone, pre):
    """The same through the Pallas delta-rule and OSGM kernels (interpret mode here): the packed
    documents' offsets are traced inside the jit."""
    chunked = tiny_model(backbone, pre, num_layers=1)
    layer = dataclasses.replace(chunked.config.layer, impl="pallas", chunk_size=16)
    model = LanguageModel(dataclasses.replace(chunked.config, layer=layer), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(chunked, nnx.Param))
    check_ragged_prefill(model)


@pytest.mark.parametrize("backbone,pre", [("deltanet", "atk"), ("kda", "osgm_apf")])
def test_ragged_generate_equals_each_row_alone(backbone, pre):
    model = tiny_model(backbone, pre)
    prompt, n = tokens(6, len(LENGTHS), T), 4
    out = generate(model, prompt, n, prompt_lengths=jnp.asarray(LENGTHS))
    assert out.shape == (len(LENGTHS), n)
    for b, length in enumerate(LENGTHS):
        np.testing.assert_array_equal(out[b], generate(model, prompt[b:b + 1, :length], n)[0])
    # the padding's values do not matter
    noise = tokens(7, len(LENGTHS), T)
    repadded = jnp.where(jnp.arange(T) < jnp.asarray(LENGTHS)[:, None], prompt, noise)
    np.testing.assert_array_equal(out, generate(model, repadded, n, prompt_lengths=list(LENGTHS)))


def test_eos_pads_the_rest_of_its_row():
    model = tiny_model("gdn", "atk")
    prompt, n, pad = tokens(8, 3, T), 6, VOCAB - 1
    free = np.asarray(generate(model, prompt, n, prompt_lengths=LENGTHS))
    eos = int(free[0, 1])  # row 0 emits it at step 1; other rows maybe later or never
    out = np.asarray(generate(model, prompt, n, prompt_lengths=LENGTHS, eos_id=eos, pad_id=pad))
    for row_free, row in zip(free, out):
        hits = np.flatnonzero(row_free == eos)
        end = hits[0] + 1 if hits.size else n
        np.testing.assert_array_equal(row[:end], row_free[:end])
        assert np.all(row[end:] == pad)
    assert np.all(out[0, 2:] == pad)  # row 0 has ended by step 1


def test_all_rows_done_stops_with_full_shape():
    model = tiny_model("kda", "none")
    # a zero final-norm scale makes every logit 0, so greedy emits token 0 at once in every row
    model.norm.scale[...] = jnp.zeros_like(model.norm.scale[...])
    out = generate(model, tokens(9, 2, T), 5, eos_id=0, pad_id=3)
    np.testing.assert_array_equal(out, [[0, 3, 3, 3, 3]] * 2)


def test_generate_ragged_and_eos_argument_errors():
    model = tiny_model("deltanet", "none", num_layers=1)
    prompt = tokens(4, 2, 3)
    for kwargs, match in [(dict(prompt_lengths=[3]), "prompt_lengths"),
                          (dict(prompt_lengths=[[3, 3]]), "prompt_lengths"),
                          (dict(prompt_lengths=[1.0, 2.0]), "prompt_lengths"),
                          (dict(prompt_lengths=[0, 3]), "prompt_lengths"),
                          (dict(prompt_lengths=[4, 3]), "prompt_lengths"),
                          (dict(eos_id=VOCAB), "eos_id"),
                          (dict(eos_id=-1), "eos_id"),
                          (dict(eos_id=2, pad_id=VOCAB), "pad_id"),
                          (dict(pad_id=None), "pad_id")]:
        with pytest.raises(ValueError, match=match):
            generate(model, prompt, 2, **kwargs)
