"""Kernel calls that keep batch and head axes sharded inside a ``jit`` over a device mesh.

A ``pallas_call`` is one opaque custom call to XLA's SPMD partitioner, which would all-gather its
operands and run it whole on every device. ``sharded_call`` wraps a kernel call in
``jax.experimental.custom_partitioning``:

- the Shardy rule names every operand's and result's axes by factor ("b t h k"); factor ``b``
  (batch rows, and document states when they are one per row) and ``h`` (heads) may stay sharded,
  every other factor needs replication;
- ``partition`` keeps whichever mesh axes the inputs carry on ``b`` and ``h`` (when they divide
  the dimension) and runs the same call on each device's shard: the kernels' grids are over
  (batch, head, ...) already, so a shard is a smaller call of the same kind.

On one device ``custom_partitioning`` inlines the call unchanged, so single-device programs are
the same as without the wrapper. Inside a ``shard_map`` (any manual mesh axis) the call is made
directly, on the local shards: there is no mesh left to partition over. On a mesh with
``Explicit`` axes (shardings in the operands' types; Pallas refuses integer indexing of sharded
refs) the call runs under a ``shard_map`` over the axes kept on ``b`` and ``h``.
It has no batching rule, so the wrapper is also a ``custom_vmap`` whose rule vmaps the plain call
(Pallas batches it over a new grid axis) and partitions that in turn, the mapped axis one more
factor that may stay sharded (the train step vmaps its packed rows: they stay on their devices).
It has no differentiation rule either: the kernels sit inside ``custom_vjp``'s forward and
backward, which are never differentiated.

Calls must not depend on where a shard starts, except through their inputs: ``delta_rule`` passes
document ids relative to the first row of the shard (see ``delta_rule._kernel_call``).
"""

import math

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def _as_tuple(entry):
    return entry if isinstance(entry, tuple) else (entry,)


def _kept_axes(mesh, shapes, axes, free):
    """{factor: mesh axes} for the factors in ``free`` that the operands carry sharded (the first
    operand naming a factor decides), when the axes divide the dimension and no other kept factor
    uses them."""
    kept, used = {}, set()
    for shape, names in zip(shapes, axes):
        spec = getattr(shape.sharding, "spec", ())
        for d, name in enumerate(names.split()):
            if name not in free or name in kept or d >= len(spec) or spec[d] is None:
                continue
            entry = _as_tuple(spec[d])
            if shape.shape[d] % math.prod(mesh.shape[a] for a in entry) == 0 and not used & set(entry):
                kept[name] = spec[d]
                used |= set(entry)
    return kept


def _explicit_call(mesh, fn, args, in_axes, out_axes, free):
    """On a mesh with ``Explicit`` axes the operands' shardings are part of their types: keep the
    mesh axes they carry on the factors in ``free`` (``_kept_axes``), reshard every other factor
    whole, and run ``fn`` under ``shard_map`` on the local shards."""
    kept = _kept_axes(mesh, [jax.typeof(a) for a in args], in_axes, free)

    def spec(names):
        return PartitionSpec(*(kept.get(n) for n in names.split()))

    in_specs = tuple(spec(a) for a in in_axes)
    args = [jax.sharding.reshard(a, s) for a, s in zip(args, in_specs)]
    # check_vma off: the kernels hold no collectives, and interpret mode cannot run under it
    return jax.shard_map(lambda *xs: tuple(fn(*xs)), in_specs=in_specs,
                         out_specs=tuple(spec(a) for a in out_axes), check_vma=False)(*args)


def match_types(cts, primals):
    """Cotangents in their primals' dtypes (a kernel may give float32 for a bf16 input, which
    ``custom_vjp`` lets through and the cotangent sum of an input used twice then refuses), and
    on a mesh with ``Explicit`` axes resharded to their primals' shardings (a kernel's cotangent
    follows the operands' kept axes), as a ``custom_vjp`` backward must return them."""
    cts = tuple(None if c is None else c.astype(p.dtype) for c, p in zip(cts, primals))
    if not jax.sharding.get_abstract_mesh().explicit_axes:
        return cts
    return tuple(None if c is None else jax.sharding.reshard(c, jax.typeof(p).sharding.spec)
                 for c, p in zip(cts, primals))


def sharded_call(fn, args, in_axes, out_axes, *, shard_batch=True, direct=False):
    """``fn(*args)`` (a tuple of arrays) with the batch and head axes of its operands kept sharded.

    ``in_axes``/``out_axes``: one string of factor names per operand/result, e.g. "b t h k";
    ``b`` and ``h`` may be sharded (``b`` only if ``shard_batch``), all other factors are whole.
    A factor name means the same dimension size everywhere it appears. ``n`` names document
    states: with ``shard_batch`` (one document per batch row) it is the batch factor ``b``.
    None operands are passed to ``fn`` as None and take no part in the partitioning.
    ``direct``: ``fn(*args)`` unpartitioned, for Mosaic GPU kernels in interpret mode (their
    interpreter runs I/O callbacks, which ``custom_partitioning`` cannot lower: KeyError
    OrderedIOEffect)."""
    if direct:
        return fn(*args)
    given = [a is not None for a in args]
    rows = (lambda a: a.replace("n", "b")) if shard_batch else (lambda a: a)
    in_axes = [rows(x) for a, x in zip(args, in_axes) if a is not None]
    out_axes = [rows(x) for x in out_axes]
    args, call_with_nones = [a for a in args if a is not None], fn

    def fn(*xs):  # the partitioned call sees the present operands only
        it = iter(xs)
        return call_with_nones(*(next(it) if p else None for p in given))

    return _partitioned(fn, args, in_axes, out_axes, {"h"} | ({"b"} if shard_batch else set()))


def _partitioned(fn, args, in_axes, out_axes, free):
    """``fn(*args)`` partitioned as ``sharded_call`` says, the factors in ``free`` kept sharded.
    Under ``vmap`` the mapped axis becomes one more free factor (the rows of a vmapped batch,
    e.g. the train step's packed rows, stay on their devices) and the vmapped ``fn`` is
    partitioned the same way."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes:
        return fn(*args)
    if mesh.explicit_axes:
        return _explicit_call(mesh, fn, args, in_axes, out_axes, free)
    names = dict.fromkeys(n for a in (*in_axes, *out_axes) for n in a.split())  # Shardy's order
    rule = ", ".join(in_axes) + " -> " + ", ".join(out_axes)

    def partition(mesh, arg_shapes, result_shape):
        kept = _kept_axes(mesh, arg_shapes, in_axes, free)

        def sharding(names_):
            return NamedSharding(mesh, PartitionSpec(*(kept.get(n) for n in names_.split())))

        return (mesh, fn, tuple(sharding(a) for a in out_axes),
                tuple(sharding(a) for a in in_axes))

    call = custom_partitioning(fn)
    call.def_partition(partition, sharding_rule=rule,
                       need_replication_factors=tuple(n for n in names if n not in free))
    call = custom_vmap(call)

    @call.def_vmap
    def _vmapped(axis_size, in_batched, *xs):
        del axis_size
        mapped = f"v{len(free)}"  # fresh: each vmap level adds one factor to ``free``
        vfn = jax.vmap(fn, in_axes=tuple(0 if b else None for b in in_batched))
        outs = _partitioned(vfn, xs, [f"{mapped} {a}" if b else a for a, b in zip(in_axes, in_batched)],
                            [f"{mapped} {a}" for a in out_axes], free | {mapped})
        return outs, jax.tree.map(lambda _: True, outs)

    return call(*args)


def lowered_once(op):
    """``op`` (a ``custom_vjp`` whose first argument is its hashable config) under
    ``jax.jit(op, static_argnums=0)``. A program that calls it many times with one config and
    the same shapes (a call a layer) then lowers its kernels once, forward and backward, and
    calls that lowering; without the ``jit`` each call site lowers its own copy. XLA inlines the
    calls, so the compiled program is the same. Lowering a Mosaic GPU kernel costs seconds of
    Python: for the 340M DeltaNet train step this is most of its compile time (NOTES, session 20)."""
    return jax.jit(op, static_argnums=0)
