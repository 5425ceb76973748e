"""One table of logical-axis rules, the (data, fsdp, tensor) device mesh, and sharded NNX state.

Models name each parameter's axes with logical names through Flax NNX metadata (flax 0.12 calls
it ``out_sharding``): ``nnx.Param(value, out_sharding=("embed", "mlp"))`` or
``kernel_init=nnx.with_partitioning(init, ("embed", "mlp"))``. ``RULES`` maps each logical name to
mesh axes; an axis already used earlier in the same array is dropped (so activations named
("batch", "seq", "embed") shard batch over data × fsdp and leave embed whole), and names without a
rule are replicated. Parameters without names are replicated.

Flax shards annotated variables eagerly when they are created, which needs a mesh: build models
with ``init_sharded`` (or inside ``use_mesh``); outside one, use ``nnx.use_eager_sharding(False)``.
"""

import contextlib
import functools
import math
import typing

import jax
import jax.extend
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("conv", None),
    ("layers", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, *, devices=None) -> Mesh:
    """A ``Mesh`` of axes ``MESH_AXES`` over ``devices`` (default all); one size may be -1 for the
    devices left over. Axes are ``AxisType.Auto``: shardings come from jit's in/out shardings."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s < 1 and s != -1 for s in sizes):
        raise ValueError(f"mesh sizes (data, fsdp, tensor) = {tuple(sizes)}: each >= 1 or -1 for at most one")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh sizes {tuple(sizes)}: {len(devices)} devices do not divide by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh (data, fsdp, tensor) = {tuple(sizes)} needs {math.prod(sizes)} devices, "
                         f"but there are {len(devices)} ({devices[0].platform})")
    return jax.make_mesh(tuple(sizes), MESH_AXES, devices=devices, axis_types=(AxisType.Auto,) * 3)


def logical_to_spec(names: typing.Sequence[str | None], rules=RULES) -> PartitionSpec:
    """The ``PartitionSpec`` of an array whose axes have logical ``names`` (None: replicated)."""
    table, used, spec = dict(rules), set(), []
    for name in names:
        axes = table.get(name) if name is not None else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, names: typing.Sequence[str | None], rules=RULES) -> NamedSharding:
    """``NamedSharding`` on ``mesh`` of an array whose axes have logical ``names``."""
    return NamedSharding(mesh, logical_to_spec(names, rules))


def state_shardings(state, mesh: Mesh, rules=RULES):
    """Shardings for an NNX state (or any pytree of ``nnx.Variable``s and arrays), same structure,
    from each variable's logical ``out_sharding`` names. Raises ``ValueError`` naming the parameter
    when a dimension does not divide by the mesh axes it is sharded over."""

    def one(path, leaf):
        names = leaf.get_metadata().get("out_sharding") if isinstance(leaf, nnx.Variable) else None
        shape = leaf.shape
        spec = logical_to_spec(names, rules) if names else PartitionSpec()
        if names is not None and len(names) != len(shape):
            raise ValueError(f"{_name(path)}: {len(names)} logical axes {names} for shape {shape}")
        for dim, axes in zip(shape, spec):
            size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
            if dim % size:
                raise ValueError(f"{_name(path)}: shape {shape} with logical axes {names} -> {spec}: "
                                 f"dimension {dim} does not divide by {size} devices")
        sharding = NamedSharding(mesh, spec)
        return leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def drop_mesh_axis(shardings, axis: str):
    """A pytree of ``NamedSharding``s with ``axis`` removed from every spec: the layout of the
    arrays after an all-gather over that mesh axis (e.g. FSDP parameters gathered for use)."""

    def one(sharding: NamedSharding) -> NamedSharding:
        spec = []
        for axes in sharding.spec:
            axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a != axis)
            spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return NamedSharding(sharding.mesh, PartitionSpec(*spec))

    return jax.tree.map(one, shardings)


def init_sharded(ctor: typing.Callable[[], typing.Any], mesh: Mesh, rules=RULES):
    """Build ``ctor()`` (an NNX module, or a tuple such as ``(model, optimizer)``) with every
    variable created directly with its ``state_shardings`` (no full copy on one device).

    The constructor is traced once and its program run equation by equation, each under its own
    cached ``jax.jit`` (``_run_sharded``), so identical layers reuse the same compiled initialisers:
    one jit of the whole constructor compiles a separate random-number subgraph per parameter (XLA
    inlines them all), minutes for a 24-layer model. The values are those of building ``ctor()``
    eagerly, on any mesh."""
    with nnx.use_eager_sharding(False):
        graphdef, abstract = nnx.split(nnx.eval_shape(ctor))
        shardings = state_shardings(abstract, mesh, rules)
        with use_mesh(mesh, rules):
            program, out_tree = jax.make_jaxpr(lambda: nnx.split(ctor())[1], return_shape=True)()
            leaves = _run_sharded(program, jax.tree.leaves(shardings), NamedSharding(mesh, PartitionSpec()))
    return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(out_tree), leaves))


def _run_sharded(program: jax.extend.core.ClosedJaxpr, out_shardings, replicated: NamedSharding):
    """The outputs of ``program`` (no inputs), each equation run by a ``jax.jit`` compiled once
    per (operation, shapes, shardings).

    An intermediate takes the sharding of a same-shaped result it feeds (a parameter's draw takes
    the parameter's, through the scaling and shifting that follow), anything else is replicated;
    each value is dropped after its last use."""
    jaxpr, Var = program.jaxpr, jax.extend.core.Var
    sharding = {var: s for var, s in zip(jaxpr.outvars, out_shardings) if isinstance(var, Var)}
    keep = set(sharding)
    for eqn in reversed(jaxpr.eqns):
        for out in filter(sharding.__contains__, eqn.outvars):
            for var in eqn.invars:
                if isinstance(var, Var) and var.aval.shape == out.aval.shape:
                    sharding.setdefault(var, sharding[out])
    last_use = {var: i for i, eqn in enumerate(jaxpr.eqns) for var in eqn.invars if isinstance(var, Var)}
    env = dict(zip(jaxpr.constvars, program.consts))

    def read(var):
        return env[var] if isinstance(var, Var) else var.val

    for i, eqn in enumerate(jaxpr.eqns):
        fn = _equation(eqn.primitive, tuple(sorted(eqn.params.items())),
                       tuple(sharding.get(var, replicated) for var in eqn.outvars))
        env.update(zip(eqn.outvars, fn(*map(read, eqn.invars))))
        for var in eqn.invars:
            if isinstance(var, Var) and last_use[var] == i and var not in keep:
                env.pop(var, None)
    # device_put is a no-op for results already in place; it places constants and repeated results
    return [jax.device_put(read(var), s) for var, s in zip(jaxpr.outvars, out_shardings)]


@functools.cache
def _equation(primitive, params, out_shardings):
    """``primitive.bind(**params)`` under ``jax.jit`` with ``out_shardings`` (a list of results)."""

    def bind(*args):
        out = primitive.bind(*args, **dict(params))
        return out if primitive.multiple_results else [out]

    return jax.jit(bind, out_shardings=list(out_shardings))


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules=RULES):
    """``jax.set_mesh(mesh)`` plus Flax's logical-axis rules, for code that shards by logical names
    (``jax.lax.with_sharding_constraint(x, logical_to_spec(...))``, eager NNX sharding)."""
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(rules):
        yield


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")
