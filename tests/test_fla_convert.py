"""FLA 0.6.0 checkpoint conversion: a state dict with FLA's names and shapes (the table below,
written from fla/layers/*.py and fla/models/*/modeling_*.py of FLA 0.6.0, random values) lands in
the right parameters with the right layout, the round trip is the identity, and bad keys or
shapes raise."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from precond_linattn.layers import LayerConfig, OSGMConfig
from precond_linattn.models import LanguageModel, ModelConfig
from precond_linattn.models.fla_convert import fla_to_params, params_to_fla

D, H, K, W, F, N, LAYERS = 32, 2, 16, 4, 48, 61, 2
# (backbone, preconditioner, layer options): FLA's DeltaNet (its default: no gate, no conv
# bias, and with both), GatedDeltaNet (V = 2K), KDA, PrecondGatedDeltaNet, PrecondKDA, and OSGM-APF
# (no FLA model; converted under the same naming rule)
MODELS = [("deltanet", "none", {}), ("deltanet", "none", dict(use_gate=True, conv_bias=True)),
          ("gdn", "none", dict(expand_v=2.0)), ("kda", "none", {}), ("gdn", "atk", {}),
          ("kda", "atk", {}), ("deltanet", "osgm_apf", dict(osgm=OSGMConfig(learn_init_scale=True)))]


def config(backbone, pre, options, tied=False):
    layer = LayerConfig(D, H, backbone=backbone, preconditioner=pre, dtype=jnp.float32, **options)
    return ModelConfig(vocab_size=N, num_layers=LAYERS, layer=layer, intermediate_size=F,
                       tie_embeddings=tied)


def fla_shapes(c: ModelConfig) -> dict:
    """FLA 0.6.0's ``state_dict()`` names and shapes of the ``*ForCausalLM`` for config ``c``."""
    lc = c.layer
    V, gdn, kda = lc.head_v_dim, lc.backbone == "gdn", lc.backbone == "kda"
    shapes = {"model.embeddings.weight": (N, D), "model.norm.weight": (D,), "lm_head.weight": (N, D)}
    for i in range(LAYERS):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.attn."
        shapes.update({p + "attn_norm.weight": (D,), p + "mlp_norm.weight": (D,),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F),
                       a + "q_proj.weight": (H * K, D), a + "k_proj.weight": (H * K, D),
                       a + "v_proj.weight": (H * V, D), a + "q_conv1d.weight": (H * K, 1, W),
                       a + "k_conv1d.weight": (H * K, 1, W), a + "v_conv1d.weight": (H * V, 1, W),
                       a + "b_proj.weight": (H, D), a + "o_norm.weight": (V,),
                       a + "o_proj.weight": (D, H * V)})
        if lc.conv_bias:
            shapes.update({a + "q_conv1d.bias": (H * K,), a + "k_conv1d.bias": (H * K,),
                           a + "v_conv1d.bias": (H * V,)})
        if gdn:
            shapes.update({a + "a_proj.weight": (H, D), a + "A_log": (H,), a + "dt_bias": (H,)})
        if kda:
            shapes.update({a + "f_proj.0.weight": (V, D), a + "f_proj.1.weight": (H * K, V),
                           a + "A_log": (H,), a + "dt_bias": (H * K,), a + "g_proj.0.weight": (V, D),
                           a + "g_proj.1.weight": (H * V, V), a + "g_proj.1.bias": (H * V,)})
        elif lc.gated:
            shapes[a + "g_proj.weight"] = (H * V, D)
        if lc.preconditioner == "atk":
            shapes.update({a + ("a_proj" if kda else "a_atk_proj") + ".weight": (H, D),
                           a + "b_atk_proj.weight": (H, D), a + "A_log_atk": (H,),
                           a + "dt_bias_atk": (H,), a + "log_atk_scale": (H,)})
        if lc.preconditioner == "osgm_apf":
            shapes.update({a + "retention_proj.weight": (H, D), a + "retention_proj.bias": (H,),
                           a + "log_d_init": (H,)})
    return shapes


def checkpoint(c: ModelConfig, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    sd = {k: rng.standard_normal(s).astype(np.float32) for k, s in fla_shapes(c).items()}
    if c.tie_embeddings:
        sd["lm_head.weight"] = sd["model.embeddings.weight"]
    return sd


def load(c: ModelConfig, sd: dict) -> LanguageModel:
    model = LanguageModel(c, rngs=nnx.Rngs(1))
    nnx.update(model, fla_to_params(sd, c))
    return model


def torch_conv1d(w, x):
    """FLA's ShortConvolution before its SiLU: nn.Conv1d(groups=D, padding=W − 1)(x)[..., :T] with
    w [D, 1, W] on x [T, D]: y_t = Σ_j w[:, 0, j] x_{t − (W − 1) + j}."""
    T = x.shape[0]
    padded = np.concatenate([np.zeros((W - 1, x.shape[1])), x])
    return np.stack([sum(w[:, 0, j] * padded[t + j] for j in range(W)) for t in range(T)])


@pytest.mark.parametrize("backbone,pre,options", MODELS)
def test_fla_checkpoint_lands_in_place_and_round_trips(backbone, pre, options):
    c = config(backbone, pre, options)
    sd = checkpoint(c)
    model = load(c, sd)
    a, fa = model.layers[1].attn, "model.layers.1.attn."
    np.testing.assert_array_equal(model.embeddings.embedding[...], sd["model.embeddings.weight"])
    np.testing.assert_array_equal(model.lm_head.kernel[...], sd["lm_head.weight"].T)
    np.testing.assert_array_equal(a.q_proj.kernel[...], sd[fa + "q_proj.weight"].T)
    np.testing.assert_array_equal(a.o_norm.scale[...], sd[fa + "o_norm.weight"])
    np.testing.assert_array_equal(model.layers[0].mlp.down_proj.kernel[...],
                                  sd["model.layers.0.mlp.down_proj.weight"].T)
    if backbone == "kda":
        np.testing.assert_array_equal(a.f_proj.layers[1].kernel[...], sd[fa + "f_proj.1.weight"].T)
        np.testing.assert_array_equal(a.g_proj.layers[1].bias[...], sd[fa + "g_proj.1.bias"])
    if pre == "atk":
        ours_a = sd[fa + ("a_proj" if backbone == "kda" else "a_atk_proj") + ".weight"]
        np.testing.assert_array_equal(a.a_atk_proj.kernel[...], ours_a.T)
        np.testing.assert_array_equal(a.log_atk_scale[...], sd[fa + "log_atk_scale"])
    # the conv layout: our ShortConvolution (SiLU) == SiLU(torch's depthwise causal Conv1d)
    x = np.random.default_rng(1).standard_normal((7, H * K)).astype(np.float32)
    want = torch_conv1d(sd[fa + "k_conv1d.weight"], x) + sd.get(fa + "k_conv1d.bias", 0.0)
    assert rel_err(a.k_conv1d(jnp.asarray(x)[None])[0], want / (1 + np.exp(-want))) <= 1e-6
    # round trip: the same names and the same values
    back = params_to_fla(nnx.state(model, nnx.Param), c)
    assert back.keys() == sd.keys()
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)


def test_tied_embeddings():
    c = config("gdn", "atk", {}, tied=True)
    sd = checkpoint(c)
    model = load(c, sd)
    assert model.lm_head is None
    back = params_to_fla(nnx.state(model, nnx.Param), c)
    assert back.keys() == sd.keys()
    np.testing.assert_array_equal(back["lm_head.weight"], sd["model.embeddings.weight"])
    # a checkpoint without the tied copy (as safetensors stores it) loads the same
    without = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    np.testing.assert_array_equal(load(c, without).embeddings.embedding[...], sd["model.embeddings.weight"])
    untied = dict(sd, **{"lm_head.weight": sd["model.embeddings.weight"] + 1})
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embeddings.weight"):
        fla_to_params(untied, c)


def test_bad_checkpoints_raise():
    c = config("kda", "atk", {})
    sd = checkpoint(c)
    name = "model.layers.1.attn.f_proj.1.weight"
    with pytest.raises(ValueError, match=rf"missing keys \['{name}'\]"):
        fla_to_params({k: v for k, v in sd.items() if k != name}, c)
    extra = "model.layers.0.attn_res_proj.weight"
    with pytest.raises(ValueError, match=rf"unexpected keys \['{extra}'\]"):
        fla_to_params(dict(sd, **{extra: np.ones((1, D), np.float32)}), c)
    with pytest.raises(ValueError, match=rf"'{name}'\] has shape \(16, 32\).*expects \(32, 16\)"):
        fla_to_params(dict(sd, **{name: sd[name].T}), c)
    # params of another config (no ATK) do not give this config's checkpoint
    other = config("kda", "none", {})
    with pytest.raises(ValueError, match="missing keys.*a_proj.weight"):
        params_to_fla(fla_to_params(checkpoint(other), other), c)
    wider = config("kda", "atk", dict(expand_v=2.0))
    with pytest.raises(ValueError, match=r"f_proj.0.weight of shape \(32, 32\).*expects \(16, 32\)"):
        params_to_fla(fla_to_params(checkpoint(wider), wider), c)
