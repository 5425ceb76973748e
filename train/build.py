"""From an ``ExperimentConfig`` to the objects of a run: the data specs and the model config.

Data: ``data.task`` / ``data.params`` with ``run.seq_len``, ``run.batch_size`` and ``run.seed``
(``data.params.seq_len``, if given, must equal ``run.seq_len``). Evaluation reads the held-out
set of the same task drawn with seed ``run.seed + 10`` (Zoology's test seed), in order; the
"text" task has no held-out set (its files fix the documents), so evaluating it is an error.

Model: ``model.preset`` (``precond_linattn.models.PRESETS``) or, when "", every field from
``model.kwargs``. Keys of ``model.kwargs`` are ``ModelConfig`` fields (num_layers, hidden_ratio,
intermediate_size, tie_embeddings, norm_eps, vocab_size) or ``LayerConfig`` fields
(preconditioner, backbone, hidden_size, num_heads, impl, chunk_size, ...; ``osgm`` / ``atk`` as
dicts of ``OSGMConfig`` / ``ATKConfig`` fields). The compute dtype is ``run.compute_dtype``;
parameters stay float32. The vocabulary is the task's unless ``model.kwargs.vocab_size`` is given
(it may be larger, never smaller).
"""

import dataclasses

import jax.numpy as jnp

from precond_linattn.layers import ATKConfig, LayerConfig, OSGMConfig
from precond_linattn.models import ModelConfig, preset
from train.config import ExperimentConfig
from train.data import DataSpec

EVAL_SEED_OFFSET = 10
_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)} - {"layer"}
_LAYER_KEYS = {f.name for f in dataclasses.fields(LayerConfig)} - {"dtype", "param_dtype"}


def data_spec(cfg: ExperimentConfig, *, evaluation: bool = False) -> DataSpec:
    """The training pipeline's spec, or (``evaluation``) the held-out one, in micro-batches. Both
    have the same task (``make_task`` of either validates it and its params)."""
    params = dict(cfg.data.params)
    if params.setdefault("seq_len", cfg.run.seq_len) != cfg.run.seq_len:
        raise ValueError(f"data.params.seq_len ({params['seq_len']}) differs from run.seq_len "
                         f"({cfg.run.seq_len}); set run.seq_len only")
    spec = DataSpec(task=cfg.data.task, params=params, batch_size=cfg.run.batch_size, seed=cfg.run.seed)
    if not evaluation:
        return spec
    if cfg.data.task == "text":
        raise ValueError("data task 'text' has no held-out set to evaluate on; set logging.eval_every=0")
    return dataclasses.replace(spec, seed=cfg.run.seed + EVAL_SEED_OFFSET, shuffle=False,
                               batch_size=cfg.run.batch_size // cfg.optim.grad_accum)


def model_config(cfg: ExperimentConfig, vocab_size: int) -> ModelConfig:
    """The ``ModelConfig`` of ``cfg.model`` for a task of ``vocab_size`` tokens."""
    kwargs = dict(cfg.model.kwargs)
    unknown = sorted(set(kwargs) - _MODEL_KEYS - _LAYER_KEYS)
    if unknown:
        raise ValueError(f"unknown model.kwargs {unknown}; valid: {sorted(_MODEL_KEYS | _LAYER_KEYS)}")
    for key, cls in (("osgm", OSGMConfig), ("atk", ATKConfig)):
        if isinstance(kwargs.get(key), dict):
            kwargs[key] = cls(**kwargs[key])
    model_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in _MODEL_KEYS}
    model_kw.setdefault("vocab_size", vocab_size)
    if model_kw["vocab_size"] < vocab_size:
        raise ValueError(f"model.kwargs.vocab_size ({model_kw['vocab_size']}) is smaller than the data "
                         f"task's vocabulary ({vocab_size})")
    dtype = jnp.dtype(cfg.run.compute_dtype)
    if not cfg.model.preset:
        return ModelConfig(layer=LayerConfig(dtype=dtype, **kwargs), **model_kw)
    base = preset(cfg.model.preset, kwargs.pop("preconditioner", "none"), dtype=dtype, **kwargs)
    return dataclasses.replace(base, **model_kw)


def flops_per_token(config: ModelConfig, num_params: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), an estimate for MFU: 2 per
    weight of every matmul (all parameters but an untied input embedding) plus, per layer and
    head, the chunked delta rule's state read and write (2 · 2·K·V) and its intra-chunk products
    (2 · C·(K + V))."""
    c = config.layer
    matmul = num_params - (0 if config.tie_embeddings else config.vocab_size * c.hidden_size)
    recurrent = config.num_layers * c.num_heads * (4 * c.head_k_dim * c.head_v_dim
                                                    + 2 * c.chunk_size * (c.head_k_dim + c.head_v_dim))
    return 3.0 * (2 * matmul + recurrent)
