"""The attention layer and its parts: config validation, FLA parameter names, the short
convolution, the gated RMSNorm, packed prefill caches and mixed precision (CPU, chunked ops)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import packed_cu_seqlens, rel_err
from precond_linattn.layers import (
    ATKConfig, BACKBONES, LayerConfig, OSGMConfig, PRECONDITIONERS, PrecondDeltaAttention, RMSNorm,
    ShortConvolution)

D, H = 32, 2


@nnx.jit
def prefill(layer, x, cu_seqlens=None):
    return layer.prefill(x, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=30, num_heads=4), "not divisible by num_heads"),
    (dict(backbone="mamba"), "backbone must be one of"),
    (dict(preconditioner="osgm+apf"), "preconditioner must be one of"),
    (dict(preconditioner="atk", osgm=OSGMConfig()), "osgm options apply only"),
    (dict(preconditioner="none", osgm=OSGMConfig()), "osgm options apply only"),
    (dict(preconditioner="osgm", atk=ATKConfig()), "atk options apply only"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(init_retention=0.99)), "init_retention applies only"),
    (dict(preconditioner="osgm_apf", osgm=OSGMConfig(init_retention=1.0)), "init_retention must be"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(d_min=2.0, d_max=1.0)),
     r"osgm.d_max must be >= osgm.d_min, got the empty box \[d_min, d_max\] = \[2.0, 1.0\]"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(d_max=float("nan"))), "osgm.d_max must be a finite"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(beta_aware=1)), "osgm.beta_aware must be a bool"),
    (dict(preconditioner="osgm", osgm=dict(eta=0.1)), "osgm must be an OSGMConfig"),
    (dict(preconditioner="atk", atk=dict(squash_x=2.0)), "atk must be an ATKConfig"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(eta=-0.1)), "eta"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(d_min=0.0)), "osgm.d_min must be > 0"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(eps=0.0)), "osgm.eps must be > 0"),
    (dict(preconditioner="osgm", osgm=OSGMConfig(eta=float("inf"))), "osgm.eta must be a finite"),
    (dict(preconditioner="atk", atk=ATKConfig(squash_x=0.5)), "atk.squash_x must be >= 1"),
    (dict(preconditioner="atk", atk=ATKConfig(squash_eps=-1e-6)), "atk.squash_eps must be > 0"),
    (dict(backbone="kda", use_gate=False), "use_gate=False does not apply"),
    (dict(use_gate=1), "use_gate must be None or a bool"),
    (dict(dtype="int32"), "dtype must be one of float32, bfloat16, float16"),
    (dict(dtype=None), "dtype must be one of"),
    (dict(param_dtype="float64"), "param_dtype must be one of"),
    (dict(head_dim=16, expand_v=0.3), "expand_v"),
    (dict(num_heads=0), "num_heads"),
    (dict(impl="triton"), "impl"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerConfig(**{"hidden_size": D, "num_heads": H, **kwargs})


def test_config_defaults():
    """Unset fields stay None; the properties give the values in use."""
    c = LayerConfig(1024, 6, backbone="gdn", preconditioner="osgm_apf", head_dim=128, expand_v=2.0)
    assert (c.key_dim, c.value_dim, c.head_v_dim) == (768, 1536, 256)
    assert c.use_gate is None and c.gated and c.variant == "OSGDN-APF"
    assert c.osgm is None and c.osgm_options == OSGMConfig(init_retention=0.999)
    assert c.atk is None and c.atk_options is None
    assert c.dtype == jnp.bfloat16 and c.param_dtype == jnp.float32
    d = LayerConfig(1024, 8, preconditioner="atk")
    assert (d.head_dim, d.head_k_dim, d.gated, d.atk, d.variant) == (None, 128, False, None, "PDN")
    assert d.atk_options == ATKConfig() and d.osgm_options is None
    assert LayerConfig(D, H, backbone="kda").gated
    # dtypes are stored canonically, so equal configs hash equally (static jit arguments)
    e = LayerConfig(D, H, dtype="bfloat16", param_dtype=np.float32)
    assert e == LayerConfig(D, H) and hash(e) == hash(LayerConfig(D, H))


def test_replace_rederives_unset_values():
    """``dataclasses.replace`` re-derives head size, gate and preconditioner options from the new
    fields; the layer built from the result has the shapes of a config built directly."""
    c = LayerConfig(64, 4, preconditioner="osgm_apf")
    wide = dataclasses.replace(c, hidden_size=128)
    assert (wide.head_k_dim, wide.key_dim, wide.head_v_dim) == (32, 128, 32)
    assert dataclasses.replace(c, num_heads=2).head_k_dim == 32
    assert [dataclasses.replace(c, backbone=b).gated for b in BACKBONES] == [False, True, True]
    osdn = dataclasses.replace(c, preconditioner="osgm")
    assert osdn.osgm_options == OSGMConfig() and osdn.variant == "OSDN"
    assert dataclasses.replace(osdn, preconditioner="osgm_apf").osgm_options.init_retention == 0.999
    pdn = dataclasses.replace(c, preconditioner="atk")
    assert (pdn.atk_options, pdn.osgm_options) == (ATKConfig(), None)
    for new, direct in [(wide, LayerConfig(128, 4, preconditioner="osgm_apf")),
                        (dataclasses.replace(c, backbone="gdn"),
                         LayerConfig(64, 4, backbone="gdn", preconditioner="osgm_apf")),
                        (osdn, LayerConfig(64, 4, preconditioner="osgm")),
                        (pdn, LayerConfig(64, 4, preconditioner="atk"))]:
        assert new == direct
        layer = nnx.eval_shape(lambda cfg=new: PrecondDeltaAttention(cfg, rngs=nnx.Rngs(0)))
        params = {".".join(map(str, path)): v.shape
                  for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
        assert params == fla_shapes(direct)


def test_replace_keeps_explicit_values():
    """Values the user set survive ``replace`` (and stay checked against the new fields)."""
    osgm = OSGMConfig(eta=0.1, init_retention=0.9, learn_init_scale=True)
    c = LayerConfig(64, 4, preconditioner="osgm_apf", head_dim=8, use_gate=False, osgm=osgm)
    wide = dataclasses.replace(c, hidden_size=128, backbone="gdn")
    assert (wide.head_k_dim, wide.key_dim, wide.gated, wide.osgm_options) == (8, 32, False, osgm)
    assert dataclasses.replace(c, use_gate=True, backbone="kda").gated
    assert dataclasses.replace(c, dtype=jnp.float32).dtype == jnp.float32
    with pytest.raises(ValueError, match="init_retention applies only"):
        dataclasses.replace(c, preconditioner="osgm")
    with pytest.raises(ValueError, match="use_gate=False does not apply"):
        dataclasses.replace(c, backbone="kda")
    with pytest.raises(ValueError, match="osgm options apply only"):
        dataclasses.replace(c, preconditioner="atk")
    with pytest.raises(ValueError, match="not divisible"):
        dataclasses.replace(LayerConfig(64, 4), num_heads=3)


def fla_shapes(c: LayerConfig):
    """Parameter shapes of FLA 0.6.0's layer for this variant, in this package's names and Flax
    layouts (kernel = weightᵀ, conv kernel [W, D]); OSDN's additions where FLA has none."""
    Dm, Hh, K, V, W = c.hidden_size, c.num_heads, c.head_k_dim, c.head_v_dim, c.conv_size
    s = {"q_proj.kernel": (Dm, Hh * K), "k_proj.kernel": (Dm, Hh * K), "v_proj.kernel": (Dm, Hh * V),
         "q_conv1d.kernel": (W, Hh * K), "k_conv1d.kernel": (W, Hh * K), "v_conv1d.kernel": (W, Hh * V),
         "b_proj.kernel": (Dm, Hh), "o_norm.scale": (V,), "o_proj.kernel": (Hh * V, Dm)}
    if c.backbone == "gdn":
        s.update({"a_proj.kernel": (Dm, Hh), "A_log": (Hh,), "dt_bias": (Hh,), "g_proj.kernel": (Dm, Hh * V)})
    if c.backbone == "kda":
        s.update({"f_proj.layers.0.kernel": (Dm, V), "f_proj.layers.1.kernel": (V, Hh * K),
                  "A_log": (Hh,), "dt_bias": (Hh * K,), "g_proj.layers.0.kernel": (Dm, V),
                  "g_proj.layers.1.kernel": (V, Hh * V), "g_proj.layers.1.bias": (Hh * V,)})
    if c.preconditioner == "atk":
        s.update({"a_atk_proj.kernel": (Dm, Hh), "b_atk_proj.kernel": (Dm, Hh), "A_log_atk": (Hh,),
                  "dt_bias_atk": (Hh,), "log_atk_scale": (Hh,)})
    if c.preconditioner == "osgm_apf":
        s.update({"retention_proj.kernel": (Dm, Hh), "retention_proj.bias": (Hh,)})
    if c.preconditioner.startswith("osgm") and c.osgm_options.learn_init_scale:
        s["log_d_init"] = (Hh,)
    if c.gated and c.backbone == "deltanet":
        s["g_proj.kernel"] = (Dm, Hh * V)
    return s


@pytest.mark.parametrize("pre", PRECONDITIONERS)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_parameters_map_one_to_one_onto_fla(backbone, pre):
    osgm = OSGMConfig(learn_init_scale=True) if pre.startswith("osgm") else None
    c = LayerConfig(96, 3, backbone=backbone, preconditioner=pre, osgm=osgm, head_dim=16,
                    expand_v=2.0, use_gate=backbone != "deltanet" or pre == "atk")
    layer = nnx.eval_shape(lambda: PrecondDeltaAttention(c, rngs=nnx.Rngs(0)))
    params = {".".join(map(str, path)): v.shape
              for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert params == fla_shapes(c)
    assert all(v.dtype == jnp.float32 for _, v in nnx.to_flat_state(nnx.state(layer, nnx.Param)))


def test_fla_style_init():
    c = LayerConfig(256, 4, backbone="gdn", preconditioner="osgm_apf", osgm=OSGMConfig(init_retention=0.99))
    layer = PrecondDeltaAttention(c, rngs=nnx.Rngs(0))
    assert abs(float(jnp.std(layer.q_proj.kernel[...])) - 0.02) < 2e-3
    dt = jax.nn.softplus(layer.dt_bias[...])  # softplus(dt_bias) = dt in [1e-3, 0.1]
    assert float(dt.min()) >= 1e-3 * (1 - 1e-5) and float(dt.max()) <= 0.1 * (1 + 1e-5)
    A = jnp.exp(layer.A_log[...])
    assert float(A.min()) > 0 and float(A.max()) <= 16
    np.testing.assert_allclose(jax.nn.sigmoid(layer.retention_proj.bias[...]), 0.99, rtol=1e-6)


@pytest.mark.parametrize("W", [4, 2, 1])
def test_short_convolution_documents_and_steps(rand, W):
    F, lengths = 6, [5, 2, 9]
    conv = ShortConvolution(F, W, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32,
                            rngs=nnx.Rngs(1))
    conv.bias[...] = rand.normal(F)
    x = rand.normal(1, sum(lengths), F)
    cu = packed_cu_seqlens(lengths)
    packed, tails = conv(x, cu_seqlens=cu), conv.tail(x, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc = x[:, a:b]
        alone = conv(doc)
        assert rel_err(packed[:, a:b], alone) <= 1e-6  # nothing leaks across documents
        ring = jnp.zeros((1, W, F))
        for t in range(b - a):  # decoding from the empty ring gives the same outputs
            y, ring = conv.step(doc[:, t], ring, jnp.asarray([t]))
            assert rel_err(y, alone[:, t]) <= 1e-6
        # the prefill's ring (position 0: slot 0 free, the tail oldest first) is that ring
        # turned by its position b − a, but for the free slot
        turned = jnp.roll(ring, -int(b - a), axis=1)
        np.testing.assert_array_equal(turned[:, 1:], tails[n:n + 1, 1:])
        assert not tails[n, 0].any()
        np.testing.assert_array_equal(conv.tail(doc), tails[n:n + 1])
    # the reference: y_t = SiLU(b + Σ_i w_i x_{t−W+1+i}), zeros before the start
    pad = jnp.pad(x[0, :5], ((W - 1, 0), (0, 0)))
    ref = jax.nn.silu(conv.bias[...] + sum(conv.kernel[...][i] * pad[i:i + 5] for i in range(W)))
    assert rel_err(packed[0, :5], ref) <= 1e-6


@pytest.mark.parametrize("activation", [None, "swish", "sigmoid"])
def test_rms_norm(rand, activation):
    norm = RMSNorm(8, eps=1e-5, activation=activation)
    norm.scale[...] = rand.normal(8)
    x, g = rand.normal(3, 2, 8), rand.normal(3, 2, 8)
    ref = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * norm.scale[...]
    if activation is not None:
        ref = ref * (g * jax.nn.sigmoid(g) if activation == "swish" else jax.nn.sigmoid(g))
    assert rel_err(norm(x, None if activation is None else g), ref) <= 1e-6
    with pytest.raises(ValueError, match="gate is required"):
        norm(x, g if activation is None else None)


def test_packed_prefill_caches_equal_separate_prefills(rand):
    """Per-document caches (memory, d from a learned d_1, conv tails) from one packed prefill."""
    c = LayerConfig(D, H, backbone="kda", preconditioner="osgm_apf", dtype=jnp.float32,
                    osgm=OSGMConfig(eta=0.5, learn_init_scale=True), impl="chunked", chunk_size=4)
    layer = PrecondDeltaAttention(c, rngs=nnx.Rngs(2))
    layer.log_d_init[...] = rand.normal(H) * 0.2
    lengths = [7, 2, 7]
    x = rand.normal(1, sum(lengths), D)
    cu = packed_cu_seqlens(lengths)
    y, cache = prefill(layer, x, cu)
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        y_n, cache_n = prefill(layer, x[:, a:b])
        assert rel_err(y[:, a:b], y_n) <= 1e-5
        for packed, alone in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_n)):
            assert rel_err(packed[n:n + 1], alone) <= 1e-5


def test_mixed_precision(rand):
    """bf16 compute (the default) with float32 parameters and states tracks float32 compute."""
    c32 = LayerConfig(D, H, preconditioner="osgm", dtype=jnp.float32, impl="chunked")
    c16 = LayerConfig(D, H, preconditioner="osgm", impl="chunked")
    layer32 = PrecondDeltaAttention(c32, rngs=nnx.Rngs(3))
    layer16 = PrecondDeltaAttention(c16, rngs=nnx.Rngs(3))
    x = rand.normal(2, 9, D)
    y32, _ = prefill(layer32, x)
    y16, cache = prefill(layer16, x)
    assert y16.dtype == jnp.bfloat16 and cache.memory.dtype == cache.precond.dtype == jnp.float32
    assert all(t.dtype == jnp.bfloat16 for t in cache.conv)
    assert rel_err(y16, y32) <= 3e-2
    y_step, cache = nnx.jit(type(layer16).step)(layer16, x[:, 0], layer16.init_cache(2))
    assert y_step.dtype == jnp.bfloat16 and cache.memory.dtype == jnp.float32


@pytest.mark.parametrize("pre", PRECONDITIONERS)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_fused_input_projection_equals_each_linear(backbone, pre, rand):
    """``_project`` (one matmul for every Linear(D, ·) fed by x) == each ``nnx.Linear`` applied
    alone, bias (APF retention, KDA gate) included, in the compute dtype."""
    layer = PrecondDeltaAttention(LayerConfig(D, H, backbone=backbone, preconditioner=pre,
                                              use_gate=True), rngs=nnx.Rngs(0))
    for m in layer._input_linears().values():  # non-zero biases, so a dropped bias shows
        if m.bias is not None:
            m.bias[...] = rand.normal(*m.bias.shape)
    x = rand.normal(3, 5, D)
    fused = layer._project(x)
    assert set(fused) >= {"q_proj", "k_proj", "v_proj", "b_proj", "g_proj"}
    for name, m in layer._input_linears().items():
        want = m(x)
        assert fused[name].dtype == want.dtype and fused[name].shape == want.shape, name
        assert rel_err(fused[name], want) == 0.0, name  # the same products and sums on the CPU


@pytest.mark.parametrize("pre", PRECONDITIONERS)
def test_convolutions_pinned_and_fenced(pre, rand):
    """Over full sequences the q / k / v convolutions' inputs and outputs are pinned row-major
    (six layout constraints) and their outputs pass one optimisation barrier (``_convolve``),
    with every preconditioner and without one; a decode step has neither. The convolutions'
    values are the same as without them."""
    layer = PrecondDeltaAttention(LayerConfig(D, H, preconditioner=pre, impl="chunked"),
                                  rngs=nnx.Rngs(0))
    x = rand.normal(2, 9, D)
    graph, state = nnx.split(layer)
    text = jax.jit(lambda x: nnx.merge(graph, state)(x)).lower(x).as_text()
    assert text.count("@LayoutConstraint") == 6
    assert text.count("optimization_barrier") == 1
    step = jax.jit(lambda x, cache: nnx.merge(graph, state).step(x, cache))
    step_text = step.lower(x[:, 0], layer.init_cache(2)).as_text()
    assert "optimization_barrier" not in step_text and "@LayoutConstraint" not in step_text
    pre_conv = layer._project(x)
    names = ("q_proj", "k_proj", "v_proj")
    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    got = layer._convolve(convs, [pre_conv[n] for n in names], None)
    for m, n, y in zip(convs, names, got):
        assert bool(jnp.all(y == m(pre_conv[n])))
