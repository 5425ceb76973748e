"""Logical axes of the language model's parameters, by parameter path (the model stays free of
sharding code).

Each ``nnx.Param`` of ``precond_linattn.models.LanguageModel`` is matched by its "/"-joined path
against ``PARAM_AXES`` (first match wins); the logical names then map to mesh axes through
``train.sharding.RULES``:

    embeddings/embedding             [V, D]       (vocab, embed)
    lm_head/kernel                   [D, V]       (embed, vocab)
    mlp/{gate,up}_proj/kernel        [D, F]       (embed, mlp)
    mlp/down_proj/kernel             [F, D]       (mlp, embed)
    attn/o_proj/kernel               [H·V, D]     (heads, embed)
    attn/{f,g}_proj/layers/0/kernel  [D, r]       (embed, -)       KDA's low-rank factors
    attn/{f,g}_proj/layers/1/kernel  [r, H·n]     (-, heads)
    attn/*_proj/kernel               [D, H·n]     (embed, heads)   q, k, v, b, a, g, atk, retention
    attn/*_conv1d/kernel             [W, H·n]     (conv, heads)
    attn/.../bias, per-head vectors  [H·n]        (heads)          A_log, dt_bias, log_atk_scale, ...
    */scale (RMSNorm)                [D] or [V]   replicated

so FSDP shards every matrix over its model-width axis and tensor parallelism splits heads (whole
heads when H divides by the tensor size) and the MLP width. A parameter no pattern matches is a
``ValueError``, so a new parameter cannot silently stay replicated.
"""

import re

from flax import nnx

PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^embeddings/embedding$", ("vocab", "embed")),
    (r"^lm_head/kernel$", ("embed", "vocab")),
    (r"/mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"/mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"/attn/o_proj/kernel$", ("heads", "embed")),
    (r"/attn/[fg]_proj/layers/0/kernel$", ("embed", None)),
    (r"/attn/[fg]_proj/layers/1/kernel$", (None, "heads")),
    (r"/attn/\w+_proj/kernel$", ("embed", "heads")),
    (r"/attn/\w+_conv1d/kernel$", ("conv", "heads")),
    (r"/attn/(\w+_proj(/layers/1)?|\w+_conv1d)/bias$", ("heads",)),
    (r"/attn/(A_log|dt_bias|A_log_atk|dt_bias_atk|log_atk_scale|log_d_init)$", ("heads",)),
    (r"(^|/)\w*norm/scale$", (None,)),
)


def param_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axis names of the parameter at ``path`` ("layers/0/attn/q_proj/kernel")."""
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path):
            if len(axes) != ndim:
                raise ValueError(f"parameter {path}: rule {pattern!r} names {len(axes)} axes {axes}, "
                                 f"but it has {ndim} dimensions")
            return axes
    raise ValueError(f"parameter {path} matches no rule of train.partitioning.PARAM_AXES; add one")


def annotate(model: nnx.Module) -> nnx.Module:
    """Set every ``nnx.Param``'s ``out_sharding`` metadata to its ``param_axes`` (in place; returns
    ``model``). Optimiser states built from the parameters inherit the metadata, so
    ``train.sharding.state_shardings`` shards them alike."""
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            name = "/".join(str(p) for p in path)
            var.set_metadata(out_sharding=param_axes(name, var[...].ndim))
    return model

