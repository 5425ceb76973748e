"""Does XLA run OSDN's phase-1 kernels beside independent work when they are on another stream?

    PYTHONPATH=. python benchmarks/stream_overlap.py [--part backward|forward]
        [--shape B T H K] [--width 1024] [--matmuls 4] [--reps 20] [--hlo DIR]

One program: phase 1 (``osgm_precondition(impl="pallas")``; ``--part backward``, the default:
its forward and its gradients of k and β for a fixed cotangent; ``forward``: k̃ alone) and,
independent of it, two chains of ``--matmuls`` bf16 matmuls [B T, width] x [width, width], the
work a training step could run while phase 1's 64 CTAs leave half of the GPU idle. Four ways:

- ``serial``: everything on the main stream;
- ``stream``: phase 1's kernels on XLA GPU stream 1 (``Options.stream``, ``compute_on``);
- ``grouped``: the same, with the part's stream call and the chains under one
  ``_scheduling_group_id`` (``set_xla_metadata``). XLA's latency-hiding scheduler schedules a
  group's members between its asynchronous call's start and done. RESULTS run 210: without a
  group the training step's stream-1 calls had nothing between their start and done. XLA's
  GPU legalizer keeps the group only on async ops and gemms, and refuses a group whose members
  are joined through ops outside it: so one async pair a group (a custom_vjp's backward
  inherits its forward's metadata: ``program``) and chains of bare gemms;
- ``tupled``: ``grouped`` with the stream call returning one tuple (``tupled``). Run 216:
  XLA gives each used result of a multi-result stream call its own async pair (a
  get-tuple-element on the stream), and ``grouped``'s gemms sat beside one of those, not
  beside the kernel's pair.

jax 0.11.2 cannot put a group on the stream call itself: ``compute_on``'s lowering sets the
call's frontend attributes and wraps its results in ``annotate_device_placement`` custom calls,
which are what the ambient metadata lands on. So ``grouped`` patches that lowering, for this
process only (``group_stream_calls``), to copy the equation's group onto the call. One device:
on a mesh the kernels' ``custom_partitioning`` would trace the call again at compile time,
outside the group. Nothing in the library changes unless the experiment shows the overlap.

Prints each way's time (median of ``--reps`` calls), phase 1 alone and the chains alone, and
per way the asynchronous pairs of the compiled program with what runs while they are in flight
(``hlo_async``). Overlap shows as a way below ``serial``; the bound is
the phase's time x the share of SMs it leaves free. On a CPU the stream annotation is ignored
and the kernels run in interpret mode: a smoke test of the script only (``--shape 1 128 2 128``).
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

from jax._src import compute_on as compute_on_lib
from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import func as func_dialect

import precond_linattn as pla
from benchmarks import hlo_async
from benchmarks.bench_delta import timeit
from pallas_kernels.osgm_precond import Options, default_options

WAYS = ("serial", "stream", "grouped", "tupled")
GROUP = "_scheduling_group_id"
TUPLE = "_stream_tuple"  # read by the lowering patch only


def group_stream_calls():
    """Patches ``compute_on``'s lowering in this process: where the equation carries a
    scheduling group, the call op (behind its results' ``annotate_device_placement`` wrappers)
    gets it too (see the module docstring); where it also carries ``TUPLE``, the call is
    lowered by ``tupled`` instead. Without a group the lowering is unchanged."""
    entry = mlir._lowerings[compute_on_lib.compute_on_p]

    def lowering(ctx, *args, **params):
        metadata = (ctx.jaxpr_eqn_ctx.xla_metadata or {}) if ctx.jaxpr_eqn_ctx else {}
        if metadata.get(GROUP) is None:
            return entry.rule(ctx, *args, **params)
        if metadata.get(TUPLE):
            return tupled(ctx, args, metadata[GROUP], **params)
        outs = entry.rule(ctx, *args, **params)
        for out in outs:
            op = out.owner
            if op.name == "stablehlo.custom_call" and "annotate_device_placement" in str(
                    op.attributes["call_target_name"]):
                op = op.operands[0].owner
            if op.name == "func.call":
                mlir._update_frontend_attributes(op, {GROUP: mlir.ir.StringAttr.get(metadata[GROUP])})
        return outs

    mlir.register_lowering(compute_on_lib.compute_on_p, lowering, inline=entry.inline)


def tupled(ctx, args, group, *, jaxpr, compute_type, out_memory_spaces, compiler_options_json):
    """``compute_on``'s stream call in ``group`` as a call of a wrapper function returning its
    results as one tuple, taken apart by ``get_tuple_element``s outside the call (results in
    device memory, no constants: as the phase's kernels have). Run 216: XLA gives each used
    result of a stream call returning several its own asynchronous call (a get-tuple-element
    on the stream, after the kernel's call-done), and a group's members landed beside one of
    those, not beside the kernel."""
    ir, hlo = mlir.ir, mlir.hlo
    assert compute_type.startswith("gpu_stream:") and compiler_options_json is None, compute_type
    assert not core.jaxpr_const_args(jaxpr), "constants"
    func_op, types, effects = mlir.lower_called_computation(
        "compute_on", jaxpr, ctx.module_context, 0, ctx.avals_in, ctx.avals_out, ctx.tokens_in)
    types = mlir.ir_tree_registry.flatten(types)[0]
    args = mlir.ir_tree_registry.flatten(
        (*ctx.dim_var_values, *[ctx.tokens_in.get(e) for e in effects], *args))[0]
    tuple_type = ir.TupleType.get_tuple(types)
    with ir.InsertionPoint.at_block_begin(ctx.module_context.module.body):
        wrapper = func_dialect.FuncOp(
            "stream_tuple", ir.FunctionType.get([a.type for a in args], [tuple_type]))
    wrapper.attributes["sym_visibility"] = ir.StringAttr.get("private")
    name = ctx.module_context.symbol_table.insert(wrapper).value
    with ir.InsertionPoint(wrapper.add_entry_block()):
        inner = func_dialect.CallOp(types, ir.FlatSymbolRefAttr.get(func_op.name.value),
                                    list(wrapper.arguments))
        func_dialect.ReturnOp([hlo.TupleOp(list(inner.results)).result])
    call = func_dialect.CallOp([tuple_type], ir.FlatSymbolRefAttr.get(name), args)
    call.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get({
        "_xla_stream_annotation": ir.StringAttr.get(compute_type.split(":")[1]),
        "inlineable": ir.StringAttr.get("false"), GROUP: ir.StringAttr.get(group)})
    outs = [hlo.GetTupleElementOp(call.result, i).result for i in range(len(types))]
    tokens, outs = outs[:len(effects)], outs[len(effects):]  # interpret mode's io callbacks
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet(dict(zip(effects, tokens)))))
    return outs


def make_inputs(key, B, T, H, K, width):
    """Unit bf16 keys, β = σ(x), the phase's output cotangent, the chains' input and weight."""
    ks = jax.random.split(key, 5)
    k = jax.random.normal(ks[0], (B, T, H, K))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    beta = jax.nn.sigmoid(jax.random.normal(ks[1], (B, T, H))).astype(jnp.bfloat16)
    ct = jax.random.normal(ks[2], (B, T, H, K)).astype(jnp.bfloat16)
    x = jax.random.normal(ks[3], (B * T, width)).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[4], (width, width)) / width ** 0.5).astype(jnp.bfloat16)
    return dict(k=k, beta=beta, ct=ct, x=x, w=w)


def chain(x, w, n):
    """n dependent bf16 matmuls x <- x w (one gemm each, no convert between them: XLA's GPU
    legalizer keeps a group only on gemms and async ops, and refuses a group whose members are
    joined through ops outside it)."""
    for _ in range(n):
        x = jnp.dot(x, w)
    return x


def group(name, way):
    """A scheduling-group context for ``grouped`` (and ``tupled``: the group, its stream call
    returning one tuple), else none."""
    metadata = {"grouped": {GROUP: name}, "tupled": {GROUP: name, TUPLE: "1"}}.get(way, {})
    return set_xla_metadata(**metadata)


def public_phase(k, beta):
    """OSDN's phase 1 as the layers call it: k̃ of ``osgm_precondition(impl="pallas")``."""
    return pla.osgm_precondition(k, beta, impl="pallas")[0]


def program(way, matmuls, part="backward", parts=("phase", "chains"), phase=public_phase):
    """(inputs) -> outputs: phase 1 (``part`` "forward": its k̃; "backward": also its gradients
    of k and β) and / or the two chains. ``grouped`` / ``tupled``: one scheduling group holds
    the chains and the ``part``'s stream call, so one async pair a group (``tupled``: the call
    returning one tuple): for "forward" the group is around the
    forward's trace (a custom_vjp's backward inherits its forward's metadata, hence no backward
    then); for "backward" around the pullback alone, the forward outside any group."""

    def f(a):
        out = []
        if "phase" in parts and part == "backward":
            kw, pullback = jax.vjp(phase, a["k"], a["beta"])
        with group("1", way):
            if "phase" in parts:
                out += [phase(a["k"], a["beta"])] if part == "forward" else list(
                    pullback(a["ct"] * kw))
            if "chains" in parts:
                out += [chain(a["x"], a["w"], matmuls), chain(a["x"] + 1, a["w"], matmuls)]
        return out

    return f


def compiled(way, matmuls, inputs, part="backward", parts=("phase", "chains")):
    """The jitted program of ``way`` compiled, phase 1 on stream 1 unless ``serial``; None (the
    error printed) where it does not compile."""
    options = Options(stream=None if way == "serial" else 1)
    try:
        with default_options(options):
            return jax.jit(program(way, matmuls, part, parts)).lower(inputs).compile()
    except Exception as e:  # noqa: BLE001 (an XLA refusal of the groups is a result)
        print(json.dumps(dict(way=way, error=f"{type(e).__name__}: {str(e)[:400]}")), flush=True)
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 2048, 8, 128], metavar=("B", "T", "H", "K"))
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--matmuls", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--part", choices=("backward", "forward"), default="backward",
                    help="the stream call in the group: the backward's (the forward beside "
                         "it, ungrouped) or the forward's (no backward)")
    ap.add_argument("--hlo", metavar="DIR", help="write each way's optimised HLO to DIR/<way>.hlo.txt")
    a = ap.parse_args(argv)
    inputs = make_inputs(jax.random.key(0), *a.shape, a.width)
    group_stream_calls()  # no effect without a scheduling group around the call (serial, stream)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, shape {a.shape}, {a.part}, "
          f"{a.matmuls} matmuls a chain of [{a.shape[0] * a.shape[1]}, {a.width}]^2, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    rows = {"phase 1 alone": compiled("serial", a.matmuls, inputs, a.part, ("phase",)),
            "chains alone": compiled("serial", a.matmuls, inputs, a.part, ("chains",))}
    rows |= {way: compiled(way, a.matmuls, inputs, a.part) for way in WAYS}
    reference = None
    for name, fn in rows.items():
        if fn is None:
            continue
        ms = timeit(fn, inputs, reps=a.reps)
        outputs = fn(inputs)
        if name in WAYS:  # the same values every way (the stream changes no arithmetic)
            reference = reference or outputs
            same = all(bool(jnp.array_equal(x, y)) for x, y in zip(outputs, reference))
        text = fn.as_text()
        pairs = hlo_async.in_flight(text)
        beside = [hlo_async.summary(p[3]) for p in pairs]
        print(json.dumps(dict(way=name, ms=ms, **({"same_values": same} if name in WAYS else {}),
                              async_pairs=len(pairs),
                              pairs_with_work_beside=sum(bool(b) for b in beside))), flush=True)
        for (comp, start, runs, _, attrs), b in list(zip(pairs, beside))[:4]:
            print(f"  {comp}: {start} ({runs}) [{attrs}]: beside {b}")
        if a.hlo:
            os.makedirs(a.hlo, exist_ok=True)
            with open(os.path.join(a.hlo, f"{name.replace(' ', '_')}.hlo.txt"), "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
