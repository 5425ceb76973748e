"""The loss and the jitted, sharded train and eval steps.

Batches on the device are dicts of int32 arrays laid out [A, b, ...]: A micro-batches of b rows
(A = ``optim.grad_accum``, b = ``run.batch_size / A``), the rows sharded over the mesh's
("data", "fsdp") axes (logical "batch"), with ``inputs`` and ``targets`` [A, b, T] and, for
packed rows only, ``cu_seqlens`` [A, b, S + 1] (``train.data.layout``; ``device_batch`` builds them).

Packed documents: the ops take ``cu_seqlens`` only for B = 1, so each row runs as its own
[1, T] sequence under ``jax.vmap`` over (row tokens, row offsets). Vmapping keeps the batch axis
(and its sharding) and each row's recurrence length T; flattening the batch to [1, B·T] instead
would make the sharded batch axis part of one sequential recurrence. The offsets' padding
(repeated T) are empty documents, which the ops skip under jit. Rows of one example (MQAR)
come without ``cu_seqlens`` and run as a plain [b, T] batch.

Precision: parameters (the optimiser's master copy) are float32; the layers compute in their
``dtype`` (bf16 by default) with float32 states; logits and the loss are float32, the logits'
gradient in the compute dtype (``train.head_loss``: the head and the loss are one op).

Gradient accumulation is a ``lax.scan`` over the A micro-batches inside one step: the loss is
the token-weighted mean over the whole batch (sum of per-token losses / supervised tokens), so
any A gives the gradient of the full batch; clipping and the update then apply once.

FSDP: parameters live sharded over "fsdp" (``train.partitioning``) and ``forward`` all-gathers
each block's parameters right before the block, so the partitioner never has to choose between
gathering weights and gathering activations (activations stay sharded by batch and heads; the
gradients are reduce-scattered back). remat: each block's forward, gather included, is
recomputed in the backward pass (``jax.checkpoint`` per block); only the residual stream between
blocks is kept. The blocks run one by one here (a Python loop, or with ``scan_layers`` a
``lax.scan`` over their parameters stacked along a new leading axis: one block to compile
instead of all of them; the gathers and checkpoints inside either), which keeps sharding out of
``precond_linattn``.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from train.data import IGNORE_INDEX
from train.head_loss import head_loss_sums

BATCH_KEYS = ("inputs", "targets", "cu_seqlens")


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """params / opt: like the states (``train.sharding.state_shardings``); gathered: like params
    without the fsdp axis (where a block's parameters are all-gathered for use); batch: the
    [A, b, ...] arrays; replicated: scalars (metrics)."""

    params: object
    opt: object
    gathered: object
    batch: NamedSharding
    replicated: NamedSharding

    def leaves(self, params, opt_state) -> tuple[list, list]:
        """The states as ``make_train_step``'s step takes them: their leaves, in tree order."""
        return jax.tree.leaves(params), jax.tree.leaves(opt_state)

    def trees(self, param_leaves, opt_leaves) -> tuple:
        """(params, opt_state) rebuilt from their leaves (the trees of ``self.params`` /
        ``self.opt``, whose leaves are the shardings)."""
        return (jax.tree.unflatten(jax.tree.structure(self.params), param_leaves),
                jax.tree.unflatten(jax.tree.structure(self.opt), opt_leaves))


def device_batch(batch: dict, micro_batches: int, sharding: NamedSharding) -> dict:
    """This host's batch (numpy [b_local, ...]) -> global arrays [A, B / A, ...] on ``sharding``,
    of the keys the step reads (``BATCH_KEYS``; ``cu_seqlens`` only from packed tasks)."""
    out = {}
    for key in (k for k in BATCH_KEYS if k in batch):
        local = np.asarray(batch[key])
        local = local.reshape(micro_batches, local.shape[0] // micro_batches, *local.shape[1:])
        shape = (micro_batches, local.shape[1] * jax.process_count(), *local.shape[2:])
        out[key] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out


def token_loss(graphdef, params, batch: dict, **forward_options) -> dict:
    """Sums over the supervised tokens of one micro-batch (targets != IGNORE_INDEX): ``nll``
    (cross-entropy of the float32 logits), ``correct`` (argmax == target) and ``count``, by
    ``head_loss_sums`` on ``forward``'s features."""
    h, w = forward(graphdef, params, batch, **forward_options)
    nll, correct, count = head_loss_sums(h, w, batch["targets"])
    return dict(nll=nll, correct=correct, count=count)


def _constrain(tree, shardings, skip=lambda path: False):
    """``tree`` with each array constrained to the sharding at the same place in ``shardings`` (a
    tree of the same structure), except where ``skip(key_path)``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = [x if skip(path) else jax.lax.with_sharding_constraint(x, s)
           for (path, x), s in zip(flat, jax.tree.leaves(shardings))]
    return treedef.unflatten(out)


def forward(graphdef, params, batch: dict, *, gathered=None, remat: bool = False,
            scan_layers: bool = False):
    """The head's input and weight of one micro-batch (``inputs`` [b, T], optional
    ``cu_seqlens``): (``LanguageModel.features`` [b, T, D], ``head_weight`` [D, V]).

    gathered: shardings like ``params`` without the fsdp axis (``StepShardings.gathered``): each
    block's parameters are all-gathered to them just before the block runs (FSDP), the others
    before the forward; None leaves the parameters as they are. remat: each block's forward
    (gather included) is recomputed in the backward pass. scan_layers: the blocks (all of one
    structure) run as a ``lax.scan`` over their stacked parameters, the same arithmetic."""
    if gathered is not None:
        params = _constrain(params, gathered, skip=lambda p: jax.tree_util.keystr(p).startswith("['layers']"))
    model = nnx.merge(graphdef, params)

    def run_blocks(layers, h, cu_seqlens):
        block_graphdef = nnx.split(layers[0])[0]
        states = [nnx.split(block)[1] for block in layers]
        shardings = [None if gathered is None else gathered["layers"][i] for i in range(len(states))]

        def run(shardings, state, h):
            if shardings is not None:
                state = _constrain(state, shardings)
            return nnx.merge(block_graphdef, state)(h, cu_seqlens=cu_seqlens)

        def block(shardings):
            f = functools.partial(run, shardings)
            return jax.checkpoint(f) if remat else f

        if scan_layers:
            body = block(shardings[0])  # every block's parameters are sharded alike
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
            return jax.lax.scan(lambda h, state: (body(state, h), None), h, stacked)[0]
        for state, s in zip(states, shardings):
            h = block(s)(state, h)
        return h

    def apply(tokens, cu_seqlens):
        return model.features(tokens, cu_seqlens=cu_seqlens, run_blocks=run_blocks)

    w = model.head_weight()
    if "cu_seqlens" not in batch:
        return apply(batch["inputs"], None), w
    return jax.vmap(lambda tokens, cu: apply(tokens[None], cu)[0])(batch["inputs"], batch["cu_seqlens"]), w


def make_train_step(graphdef, tx: optax.GradientTransformation, shardings: StepShardings, *,
                    remat: bool = False, scan_layers: bool = False):
    """``step(param_leaves, opt_leaves, batch) -> (param_leaves, opt_leaves, metrics)``, jitted
    with the given shardings and the states donated. metrics: loss, accuracy (on supervised
    tokens), tokens (supervised), grad_norm (of the batch gradient, before clipping). remat,
    scan_layers: as ``forward``'s.

    The states travel as lists of their leaves (``StepShardings.leaves`` / ``trees`` convert):
    a call flattens its arguments and unflattens its results on the host, which for ``nnx.State``
    trees costs ~9 ms a step at the 340M shape (~340 parameter and ~680 optimiser leaves; lists:
    ~0.1 ms), host time that bounds the step of a small model (benchmarks/NOTES.md, session 19)."""

    def micro_loss(params, batch, total):
        sums = token_loss(graphdef, params, batch, gathered=shardings.gathered, remat=remat,
                          scan_layers=scan_layers)
        return sums["nll"] / total, sums

    def step(params, opt_state, batch):
        total = jnp.maximum(jnp.sum(batch["targets"] != IGNORE_INDEX), 1).astype(jnp.float32)

        def accumulate(grads, micro):
            (_, sums), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro, total)
            return jax.tree.map(jnp.add, grads, g), sums

        grads, sums = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        sums = jax.tree.map(jnp.sum, sums)
        metrics = dict(loss=sums["nll"] / total, accuracy=sums["correct"] / total, tokens=sums["count"],
                       grad_norm=optax.tree.norm(grads))
        return params, opt_state, metrics

    s = shardings

    def leaf_step(param_leaves, opt_leaves, batch):
        params, opt_state, metrics = step(*s.trees(param_leaves, opt_leaves), batch)
        return *s.leaves(params, opt_state), metrics

    p, o = s.leaves(s.params, s.opt)
    return jax.jit(leaf_step, in_shardings=(p, o, s.batch), out_shardings=(p, o, s.replicated),
                   donate_argnums=(0, 1))


def make_eval_step(graphdef, shardings: StepShardings, *, scan_layers: bool = False):
    """``eval_step(params, batch) -> token_loss sums`` for a batch of one micro-batch [1, b, ...]."""

    def step(params, batch):
        micro = jax.tree.map(lambda x: x[0], batch)
        return token_loss(graphdef, params, micro, gathered=shardings.gathered, scan_layers=scan_layers)

    s = shardings
    return jax.jit(step, in_shardings=(s.params, s.batch), out_shardings=s.replicated)
