"""FLA 0.6.0 checkpoints <-> ``LanguageModel`` parameters (an ``nnx.State`` of ``nnx.Param``).

A checkpoint is a mapping FLA name -> array, e.g. ``{k: v.float().numpy() for k, v in
torch_model.state_dict().items()}`` of a ``DeltaNetForCausalLM``, ``GatedDeltaNetForCausalLM``,
``KDAForCausalLM``, ``PrecondGatedDeltaNetForCausalLM`` or ``PrecondKDAForCausalLM`` (FLA 0.6.0,
``fla/models/*/modeling_*.py`` and ``fla/layers/*.py``):

    params = fla_to_params(checkpoint, config)      # then nnx.update(model, params)
    checkpoint = params_to_fla(nnx.state(model, nnx.Param), config)

FLA names and shapes (D hidden, H heads, K / V head key / value size, W conv size, F MLP width,
N vocabulary; ``model.layers.{i}.`` before every layer name, ``attn.`` before the attention's):

    FLA name                           FLA shape      here (nnx path)                  layout
    model.embeddings.weight            [N, D]         embeddings.embedding             same
    lm_head.weight                     [N, D]         lm_head.kernel [D, N]            transposed
    model.norm.weight                  [D]            norm.scale                       same
    attn_norm.weight, mlp_norm.weight  [D]            attn_norm.scale, mlp_norm.scale  same
    mlp.{gate,up}_proj.weight          [F, D]         mlp.{gate,up}_proj.kernel        transposed
    mlp.down_proj.weight               [D, F]         mlp.down_proj.kernel             transposed
    attn.{q,k}_proj.weight             [H·K, D]       attn.{q,k}_proj.kernel           transposed
    attn.v_proj.weight                 [H·V, D]       attn.v_proj.kernel               transposed
    attn.{q,k}_conv1d.weight           [H·K, 1, W]    attn.{q,k}_conv1d.kernel [W, H·K]  w[:, 0].T
    attn.v_conv1d.weight               [H·V, 1, W]    attn.v_conv1d.kernel [W, H·V]    w[:, 0].T
    attn.{q,k,v}_conv1d.bias           [H·K | H·V]    attn.{q,k,v}_conv1d.bias         (conv_bias)
    attn.b_proj.weight                 [H, D]         attn.b_proj.kernel               transposed
    attn.g_proj.weight                 [H·V, D]       attn.g_proj.kernel               (use_gate)
    attn.o_norm.weight                 [V]            attn.o_norm.scale                same
    attn.o_proj.weight                 [D, H·V]       attn.o_proj.kernel               transposed
  GDN:
    attn.a_proj.weight                 [H, D]         attn.a_proj.kernel               transposed
    attn.A_log, attn.dt_bias           [H]            same names                       same
  KDA:
    attn.f_proj.0.weight               [V, D]         attn.f_proj.layers.0.kernel      transposed
    attn.f_proj.1.weight               [H·K, V]       attn.f_proj.layers.1.kernel      transposed
    attn.A_log [H], attn.dt_bias       [H·K]          same names                       same
    attn.g_proj.0.weight               [V, D]         attn.g_proj.layers.0.kernel      transposed
    attn.g_proj.1.weight, .bias        [H·V, V], [H·V]  attn.g_proj.layers.1.{kernel, bias}
  ATK (PrecondGatedDeltaNet; PrecondKDA names its ATK decay projection ``a_proj``):
    attn.a_atk_proj.weight             [H, D]         attn.a_atk_proj.kernel           transposed
    attn.b_atk_proj.weight             [H, D]         attn.b_atk_proj.kernel           transposed
    attn.A_log_atk, attn.dt_bias_atk,  [H]            same names                       same
    attn.log_atk_scale

FLA 0.6.0 has no DeltaNet + ATK nor OSGM model; those variants convert under the same rule
(``attn.a_atk_proj.weight`` ..., and OSGM's ``attn.log_d_init`` [H], ``attn.retention_proj.weight``
[H, D] / ``.bias`` [H]) for a PyTorch port that uses these names. Tied embeddings: torch's
``state_dict()`` lists ``lm_head.weight`` beside ``model.embeddings.weight``; it may be absent
(safetensors drop it) and must equal the embeddings. Only weights are converted: the config must
match the checkpoint's (sizes, heads, ``expand_v``, conv size / bias, gates, ``allow_neg_eigval``,
eps, ATK squash options, ``num_v_heads`` = ``num_heads``); FLA-only modules (attention-residual
projections, hybrid softmax-attention layers) are unexpected keys.
"""

from collections.abc import Mapping

import numpy as np
from flax import nnx

from precond_linattn.models.config import ModelConfig
from precond_linattn.models.counting import abstract_model

TIED_HEAD, EMBEDDINGS = "lm_head.weight", "model.embeddings.weight"
_LAYOUTS = {
    "same": (lambda w: w, lambda w: w),
    "linear": (lambda w: w.T, lambda w: w.T),                          # [in, out] <-> [out, in]
    "conv": (lambda w: w.T[:, None, :], lambda w: w[:, 0, :].T),        # [W, D] <-> [D, 1, W]
}


def _fla_name(path: tuple, config: ModelConfig) -> tuple[str, str]:
    """(FLA name, layout) of the parameter at nnx ``path``.

    Leaf ``embedding`` / ``scale`` -> ``weight`` (same), ``kernel`` -> ``weight`` (transposed, or the
    conv layout under a ``*_conv1d``); an nnx.Sequential's ``layers.{j}`` -> ``{j}``; the top-level
    ``layers.{i}`` -> ``model.layers.{i}``; PrecondKDA's ATK decay projection is ``a_proj``."""
    *modules, leaf = (str(p) for p in path)
    layout = "same"
    if leaf == "kernel":
        layout = "conv" if modules[-1].endswith("conv1d") else "linear"
    if leaf in ("kernel", "embedding", "scale"):
        leaf = "weight"
    modules = [m for i, m in enumerate(modules) if not (i > 0 and m == "layers")]
    if config.layer.backbone == "kda" and config.layer.preconditioner == "atk":
        modules = ["a_proj" if m == "a_atk_proj" else m for m in modules]
    prefix = [] if modules[0] == "lm_head" else ["model"]
    return ".".join(prefix + modules + [leaf]), layout


def _table(config: ModelConfig) -> dict:
    """FLA name -> (nnx path, layout, FLA shape, parameter dtype) for every parameter."""
    table = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(config), nnx.Param)):
        name, layout = _fla_name(path, config)
        fla_shape = _LAYOUTS[layout][0](np.broadcast_to(False, var.shape)).shape  # no allocation
        table[name] = (path, layout, fla_shape, var.dtype)
    return table


def _check_names(given, expected, what: str) -> None:
    missing, unexpected = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} does not match the model config: missing keys {missing}, "
                         f"unexpected keys {unexpected}")


def fla_to_params(state_dict: Mapping[str, np.ndarray], config: ModelConfig) -> nnx.State:
    """The ``nnx.Param`` state of ``LanguageModel(config)`` holding an FLA 0.6.0 checkpoint:
    Linear weights W [out, in] -> kernel Wᵀ [in, out], conv weights w [D, 1, W] -> w[:, 0]ᵀ [W, D],
    the rest as is, cast to the parameter dtype. Raises ValueError naming missing, unexpected or
    mis-shaped keys (with both shapes) and an untied ``lm_head.weight`` for a tied config."""
    table = _table(config)
    given = dict(state_dict)
    if config.tie_embeddings and TIED_HEAD in given:
        head = given.pop(TIED_HEAD)
        if EMBEDDINGS in given and not np.array_equal(np.asarray(head), np.asarray(given[EMBEDDINGS])):
            raise ValueError(f"state_dict's {TIED_HEAD} differs from {EMBEDDINGS}: the checkpoint "
                             "has untied embeddings; use ModelConfig(tie_embeddings=False)")
    _check_names(given, table, "state_dict")
    flat = []
    for name, (path, layout, fla_shape, dtype) in table.items():
        value = np.asarray(given[name])
        if value.shape != fla_shape:
            raise ValueError(f"state_dict[{name!r}] has shape {value.shape}; the model config "
                             f"expects {fla_shape} (FLA layout)")
        flat.append((path, nnx.Param(np.asarray(_LAYOUTS[layout][1](value), dtype))))
    return nnx.from_flat_state(flat)


def params_to_fla(params: nnx.State, config: ModelConfig) -> dict[str, np.ndarray]:
    """The FLA 0.6.0 state dict (name -> float32 numpy array) of ``LanguageModel(config)``
    parameters ``params`` (``nnx.state(model, nnx.Param)``), the inverse of ``fla_to_params``;
    tied embeddings also give ``lm_head.weight``, as torch's ``state_dict()`` does."""
    table = _table(config)
    values = {path: var[...] for path, var in nnx.to_flat_state(params)}
    names = {_fla_name(path, config)[0]: path for path in values}
    _check_names(names, table, "params")
    out = {}
    for name, (path, layout, fla_shape, _) in table.items():
        value = np.asarray(_LAYOUTS[layout][0](np.asarray(values[path], np.float32)))
        if value.shape != fla_shape:
            raise ValueError(f"params at {'.'.join(map(str, path))} give {name} of shape "
                             f"{value.shape}; the model config expects {fla_shape} (FLA layout)")
        out[name] = value
    if config.tie_embeddings:
        out[TIED_HEAD] = out[EMBEDDINGS]
    return out
