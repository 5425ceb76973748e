"""Language models of all twelve variants on a tiny shape (CPU, float32 compute, chunked ops).

Decoding (prefill + steps, or steps from the empty cache) equals one full forward pass; packed
documents equal separate runs; every parameter gets a non-zero gradient; presets have the sizes
their names say (by ``jax.eval_shape``); ``generate`` runs under jit and greedy equals the argmax
of repeated full forwards."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import packed_cu_seqlens, rel_err
from precond_linattn.layers import ATKConfig, BACKBONES, LayerConfig, OSGMConfig, PRECONDITIONERS
from precond_linattn.models import (
    LanguageModel, ModelConfig, NOMINAL_PARAMS, PRESETS, count_params, decode_state_bytes, generate,
    preset, sample)

VOCAB, T, PROMPT = 61, 13, 6
VARIANTS = [(b, p) for b in BACKBONES for p in PRECONDITIONERS]


def tiny_config(backbone, pre, num_layers=2):
    """``num_layers`` layers, width 32, 2 heads (K = 16, V = 16 or 32), every option of the variant
    switched on (OSGM with a large step and a learned initial scale; output gate, conv bias and
    negative eigenvalues for DeltaNet)."""
    osgm = OSGMConfig(eta=0.5, learn_init_scale=True) if pre.startswith("osgm") else None
    layer = LayerConfig(32, 2, backbone=backbone, preconditioner=pre, osgm=osgm,
                        expand_v=2.0 if backbone == "gdn" else 1.0, conv_bias=backbone == "deltanet",
                        allow_neg_eigval=backbone == "deltanet", use_gate=True,
                        dtype=jnp.float32, impl="chunked", chunk_size=4)
    return ModelConfig(vocab_size=VOCAB, num_layers=num_layers, layer=layer)


def tiny_model(backbone, pre, num_layers=2):
    model = LanguageModel(tiny_config(backbone, pre, num_layers), rngs=nnx.Rngs(0))
    # FLA's init makes every block nearly the identity; scale the weights up so that all paths
    # (convolutions, gates, preconditioners, memory) move the logits.
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * 10.0 if p.ndim == 2 else p, state))
    return model


def tokens(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


@nnx.jit
def forward(model, x):
    return model(x)


@nnx.jit
def forward_packed(model, x, cu):
    return model(x, cu_seqlens=cu)


@nnx.jit
def prefill(model, x):
    return model.prefill(x)


@nnx.jit
def step(model, token, cache):
    return model.step(token, cache)


@pytest.mark.parametrize("backbone,pre", VARIANTS)
def test_decoding_and_packing_match_forward(backbone, pre):
    model = tiny_model(backbone, pre, num_layers=1)  # two layers: in the generate test
    x = tokens(1, 2, T)
    full = forward(model, x)

    # prefill the prompt, then one token at a time
    logits, cache_prefill = prefill(model, x[:, :PROMPT])
    decoded, cache = [logits], cache_prefill
    for t in range(PROMPT, T):
        logits, cache = step(model, x[:, t], cache)
        decoded.append(logits)
    assert rel_err(jnp.stack(decoded, 1), full[:, PROMPT - 1:]) <= 1e-5

    # every token from the empty cache; after the prompt the cache equals the prefill's
    cache = model.init_cache(2)
    for t in range(T):
        logits, cache = step(model, x[:, t], cache)
        assert rel_err(logits, full[:, t]) <= 1e-5
        if t == PROMPT - 1:
            assert (cache.position == PROMPT).all() and not cache_prefill.position.any()
            for a, b in zip(jax.tree.leaves(cache.ordered()), jax.tree.leaves(cache_prefill.ordered()),
                            strict=True):
                assert rel_err(a, b) <= 1e-5

    # packed documents (lengths T − 4 and T along one row) == separate runs (causality: the
    # first T − 4 logits of a full run are those of its prefix)
    packed = forward_packed(model, jnp.concatenate([x[1, :T - 4], x[0]])[None],
                            packed_cu_seqlens([T - 4, T]))[0]
    assert rel_err(packed[:T - 4], full[1, :T - 4]) <= 1e-5
    assert rel_err(packed[T - 4:], full[0]) <= 1e-5


def cross_entropy(model, x):
    logits = model(x[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, x[:, 1:, None], axis=-1))


@pytest.mark.parametrize("backbone,pre", VARIANTS)
def test_every_parameter_gets_a_gradient(backbone, pre):
    model = tiny_model(backbone, pre, num_layers=1)
    grads = nnx.jit(nnx.grad(cross_entropy))(model, tokens(2, 2, T))
    flat = nnx.to_flat_state(grads)
    assert len(flat) == len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, g in flat:
        g = np.asarray(g[...])
        assert np.all(np.isfinite(g)), path
        assert np.abs(g).max() > 0, f"zero gradient for {'/'.join(map(str, path))}"


def test_generate_greedy_equals_argmax_of_full_forwards():
    model = tiny_model("kda", "osgm_apf")
    prompt, n = tokens(3, 2, PROMPT), 5
    out = generate(model, prompt, n)
    # a full forward over prompt + output gives, by causality, the logits of every repeated
    # forward over a prefix: each generated token is the argmax after its prefix
    logits = forward(model, jnp.concatenate([prompt, out], 1))
    np.testing.assert_array_equal(out, jnp.argmax(logits[:, PROMPT - 1:-1], -1))
    # sampling: valid tokens, reproducible with the same key, top-1 is greedy
    key = jax.random.key(7)
    sampled = generate(model, prompt, n, rng=key, temperature=1.3, top_k=5)
    assert sampled.shape == (2, n) and int(sampled.min()) >= 0 and int(sampled.max()) < VOCAB
    np.testing.assert_array_equal(sampled, generate(model, prompt, n, rng=key, temperature=1.3, top_k=5))
    logits = logits[:, -1]
    np.testing.assert_array_equal(sample(logits, key, 0.7, 1, greedy=False), jnp.argmax(logits, -1))


def test_generate_argument_errors():
    model = tiny_model("deltanet", "none")
    prompt = tokens(4, 1, 3)
    for kwargs, match in [(dict(max_new_tokens=0), "max_new_tokens"),
                          (dict(max_new_tokens=2, temperature=1.0), "rng"),
                          (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
                          (dict(max_new_tokens=2, top_k=VOCAB + 1), "top_k")]:
        with pytest.raises(ValueError, match=match):
            generate(model, prompt, **kwargs)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, prompt[0], 2)
    # the cache of step is the ModelCache of prefill / init_cache, not its layers' tuple
    with pytest.raises(ValueError, match="cache must be the ModelCache of prefill / init_cache, got tuple"):
        model.step(prompt[:, 0], model.init_cache(1).layers)


@pytest.mark.parametrize("name", [n for n in PRESETS if "340m" in n])
def test_340m_presets_within_ten_percent(name):
    for pre in PRECONDITIONERS:
        n = count_params(preset(name, pre))
        assert abs(n / NOMINAL_PARAMS[name] - 1) <= 0.10, (name, pre, n)


def test_counts_and_state_bytes_match_a_real_model():
    for backbone, pre in [("gdn", "osgm_apf"), ("kda", "atk")]:
        config = tiny_config(backbone, pre)
        model = LanguageModel(config, rngs=nnx.Rngs(0))
        real = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert count_params(config) == real
        assert decode_state_bytes(config, batch=3).total == sum(
            x.nbytes for x in jax.tree.leaves(model.init_cache(3)))
    # OSGM adds two slots of one float32 per head and key channel (the decode step's spare):
    # 2/V of the memory; ATK one: 1/V
    c = preset("deltanet-340m", "osgm")
    with_d, without = decode_state_bytes(c), decode_state_bytes(preset("deltanet-340m"))
    with_a = decode_state_bytes(preset("deltanet-340m", "atk"))
    assert with_d.preconditioner * 64 == with_a.preconditioner * 128 == with_d.memory == without.memory
    assert with_d.total - without.total == c.num_layers * 8 * 2 * 128 * 4
    assert without.position == 4 and without.preconditioner == 0  # one int32 position a row
    # tied embeddings count once: untying adds the head, vocab × width
    untied = dataclasses.replace(c, tie_embeddings=False)
    assert count_params(untied) - count_params(c) == 32000 * 1024


def test_mlp_width_follows_hidden_ratio():
    """The SwiGLU width is derived on use (FLA's rule), so replacing hidden_ratio resizes the MLP;
    an explicit intermediate_size wins."""
    c = ModelConfig(vocab_size=VOCAB, num_layers=1, layer=LayerConfig(96, 2))
    assert (c.intermediate_size, c.mlp_width) == (None, 256)  # int(96·4·2/3) = 256
    wide = dataclasses.replace(c, hidden_ratio=8)
    assert wide.mlp_width == 512  # int(96·8·2/3) = 512
    mlp = nnx.eval_shape(lambda: LanguageModel(wide, rngs=nnx.Rngs(0))).layers[0].mlp
    assert mlp.gate_proj.kernel.shape == (96, 512) and mlp.down_proj.kernel.shape == (512, 96)
    fixed = dataclasses.replace(c, intermediate_size=48)
    assert dataclasses.replace(fixed, hidden_ratio=8).mlp_width == 48
    assert preset("deltanet-340m").mlp_width == 2816  # FLA's DeltaNet-340M
    with pytest.raises(ValueError, match="intermediate_size"):
        dataclasses.replace(c, intermediate_size=0)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_layers_rederive_under_replace(name):
    """Switching a preset's preconditioner or width with ``replace`` gives the layer the preset
    builds directly (derived head size, gate and options are never stale)."""
    layer = preset(name, "osgm_apf").layer
    assert dataclasses.replace(layer, preconditioner="osgm") == preset(name, "osgm").layer
    if layer.osgm is None:  # deltanet-1.3b sets its own OSGM options, which do not apply to ATK
        assert dataclasses.replace(layer, preconditioner="atk") == preset(name, "atk").layer
        assert dataclasses.replace(layer, preconditioner="none") == preset(name).layer
    if layer.head_dim is None:
        double = dataclasses.replace(layer, hidden_size=2 * layer.hidden_size)
        assert double.head_k_dim == 2 * layer.head_k_dim


def test_model_config_errors():
    layer = LayerConfig(32, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(vocab_size=0, num_layers=1, layer=layer)
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig(vocab_size=10, num_layers=0, layer=layer)
    with pytest.raises(ValueError, match="LayerConfig"):
        ModelConfig(vocab_size=10, num_layers=1, layer=dict(hidden_size=32))
    with pytest.raises(ValueError, match="unknown preset"):
        preset("deltanet-7b")
    with pytest.raises(ValueError, match="atk options apply only"):
        preset("deltanet-340m", "osgm", atk=ATKConfig())
    with pytest.raises(ValueError, match="preconditioner must be one of"):
        preset("deltanet-340m", "osgm+apf")


def test_main_lists_presets(monkeypatch, capsys):
    from precond_linattn.models import __main__ as cli

    monkeypatch.setattr(cli, "PRESETS", {"deltanet-340m": PRESETS["deltanet-340m"]})
    cli.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("deltanet")]
    assert [r[1] for r in rows] == ["DeltaNet", "OSDN", "OSDN-APF", "PDN"]
    # OSDN's d in two slots: 2/V of S; PDN's A: 1/V
    assert rows[0][2] == "341.6M" and rows[0][-1] == "0.00%" and rows[1][-1] == "1.56%"
    assert rows[3][-1] == "0.78%"


def test_head_backward_runs_in_the_compute_dtype():
    """The LM head's gradients: in float32 those of the plain matmul exactly; in bf16 within
    bf16's rounding of them, from products whose operands are all bf16 (no float32 dot, which
    the GPU would run as TF32 at a quarter of the speed)."""
    from precond_linattn.models.lm import head_logits
    kh, kw, kg = jax.random.split(jax.random.PRNGKey(3), 3)
    h, w = jax.random.normal(kh, (2, 5, 16)), jax.random.normal(kw, (16, 24))
    g = jax.random.normal(kg, (2, 5, 24))
    pull = lambda f, *a: jax.vjp(f, *a)[1](g)  # noqa: E731
    plain = lambda h, w: jnp.matmul(h, w, preferred_element_type=jnp.float32)  # noqa: E731
    for got, want in zip(pull(head_logits, h, w), pull(plain, h, w)):
        np.testing.assert_array_equal(got, want)
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    for got, want in zip(pull(head_logits, hb, wb), pull(plain, h, w)):
        assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 1e-2
    hlo = jax.jit(lambda h, w: pull(head_logits, h, w)).lower(hb, wb).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 2 and all("f32>, tensor" not in d.split("->")[0] for d in dots), dots
