"""The optax optimiser of an ``OptimConfig`` and the papers' recipes.

Weight-decay rule: a parameter is decayed unless it has ndim ≤ 1 (biases, norm scales, per-head
gates and scales) or one of ``OptimConfig.no_decay``'s regexes is found in its "/"-joined path
(e.g. "layers/0/attn/A_log", "layers/0/attn/retention_proj/kernel"). The defaults exclude the
papers' no-decay set — gates (A_log, dt_bias), biases, norms and the preconditioner's parameters
(log_atk_scale, eta, retention, learnt initial scales "*init*") — and keep decay on embeddings,
short-convolution kernels and all other matrices; add "embed" to exclude embeddings too.
"""

import dataclasses
import re

import jax
import optax

from train.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int | None = None) -> optax.Schedule:
    """Linear warmup 0 → peak_lr over warmup_steps, then cosine to min_lr at ``cfg.total_steps``
    (when None, at ``total_steps``: the run's steps)."""
    if (cfg.total_steps or total_steps) is None:
        raise ValueError("the schedule's length is unknown: set optim.total_steps or pass total_steps")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.peak_lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps or total_steps, end_value=cfg.min_lr)


def weight_decay_mask(params, no_decay: tuple[str, ...] = OptimConfig.no_decay):
    """A pytree of bools like ``params`` (True: decay); the rule is in the module docstring."""
    patterns = [re.compile(p) for p in no_decay]

    def decays(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        return leaf.ndim > 1 and not any(p.search(name) for p in patterns)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimConfig, total_steps: int | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on ``lr_schedule(cfg, total_steps)`` with
    ``weight_decay_mask``. One call of ``update`` is one optimizer step: the train step
    accumulates the ``cfg.grad_accum`` micro-batches itself (the gradient of the token-weighted
    mean loss over the whole batch, ``train.step``), and clipping applies to that gradient."""
    mask = lambda params: weight_decay_mask(params, cfg.no_decay)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=mask))


def osdn_recipe(total_steps: int = 20480, **changes) -> OptimConfig:
    """OSDN paper: AdamW, peak 1e-3, cosine with warmup, clip 1.0. Unreported, taken from FLA's
    flame 340M recipe the paper trains with: warmup 1024, min lr 0.1 × peak, eps 1e-15, betas
    (0.9, 0.95), weight decay 0.1."""
    return dataclasses.replace(OptimConfig(peak_lr=1e-3, min_lr=1e-4, warmup_steps=1024, weight_decay=0.1,
                                           grad_clip=1.0, total_steps=total_steps), **changes)


def pdn_recipe(total_steps: int, tokens_per_step: int = 524288, **changes) -> OptimConfig:
    """PDN paper: AdamW, peak 4e-4 cosine to 4e-5, warmup 0.5B tokens, weight decay 0.01, clip 1.0
    (betas and eps as ``osdn_recipe``)."""
    warmup = round(0.5e9 / tokens_per_step)
    return dataclasses.replace(OptimConfig(peak_lr=4e-4, min_lr=4e-5, warmup_steps=warmup, weight_decay=0.01,
                                           grad_clip=1.0, total_steps=total_steps), **changes)
