"""delta_rule(impl="pallas") inside a jit over 8 fake CPU devices, run by tests/test_pallas_sharding.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/pallas_sharding_subprocess.py CASE...

Runs each CASE in turn, printing "ok" after each that passes. CASE: dense_scalar, dense_vector,
packed, osdn_dense, vmap_packed, atk_head, atk_channel, osgm_pieces, smap_delta, smap_osgm,
smap_atk, explicit_delta, explicit_osgm, explicit_atk.

Mesh (data=4, tensor=2); batch over data, heads over tensor (packed documents: one batch row,
heads over tensor; osdn_dense: OSDN-APF, the Pallas OSGM phase 1 then the Pallas core;
vmap_packed: OSDN-APF on rows of packed documents vmapped over the batch, as train.step runs
them, rows over data). Checks
that outputs, final states and all gradients equal the one-device run
and that the compiled program has no all-gather (the kernels run on each device's shard).
The smap_* cases call the operations inside ``jax.shard_map`` (check_vma=True) instead, the
explicit_* ones under ``jit`` on a mesh with Explicit axes; an op's smap_* and explicit_* cases
in one process share its one-device run.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import precond_linattn as pla
from conftest import fixed_loss_step  # tests/ is this script's path
from test_pallas_atk import make_inputs as atk_inputs
from test_pallas_delta import make_inputs
from test_pallas_osgm import make_inputs as osgm_inputs, poison_token_loops

B, C = 4, 16


def delta_fn(cu_seqlens, osdn):
    """x -> (o, S) of delta_rule(impl="pallas"); osdn: x -> (o, S, Σ sin(d_T)) with the write key
    and d_T from osgm_precondition(impl="pallas") (the third term joins the loss)."""

    def fn(x):
        write_key = x.get("write_key")
        if osdn:
            write_key, d_final = pla.osgm_precondition(
                x["k"], x["beta"], eta=0.5, retention=x["retention"], initial_state=x["d0"],
                output_final_state=True, cu_seqlens=cu_seqlens, impl="pallas")
        o, final = pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=write_key,
                                  log_decay=x.get("log_decay"), initial_state=x["initial_state"],
                                  output_final_state=True, cu_seqlens=cu_seqlens, impl="pallas",
                                  chunk_size=C)
        return (o, final, jnp.sum(jnp.sin(d_final))) if osdn else (o, final)

    return fn


def main(case):
    """The delta core (dense with each decay, packed documents, or OSDN-APF) under jit on the
    (data=4, tensor=2) mesh: ``check_sharded``."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    packed = case == "packed"
    osdn = case == "osdn_dense"
    decay = "scalar" if packed else "none" if osdn else case.split("_")[1]
    cu = jnp.asarray([0, 5, 22, 37], jnp.int32) if packed else None
    x = make_inputs(0, decay, b=1 if packed else B, n_init=3 if packed else B)
    if osdn:  # the write key comes from the preconditioner
        del x["write_key"]
        rng = np.random.default_rng(2)
        H, K = x["k"].shape[2:]
        x["retention"] = jnp.asarray(rng.uniform(0.9, 1.0, x["beta"].shape), jnp.float32)
        x["d0"] = jnp.asarray(rng.uniform(0.5, 2.0, (B, H, K)), jnp.float32)
    batch = None if packed else "data"
    spec = {name: P(batch, None, "tensor", *(None,) * (a.ndim - 3)) for name, a in x.items()}
    spec["initial_state"] = P(batch, "tensor", None, None)
    spec["d0"] = P(batch, "tensor", None)
    # dβ, dg, dr, dk, dd0 sum over K or V: XLA fuses those sums per program shape
    check_sharded(mesh, fixed_loss_step(delta_fn(cu, osdn)), x, spec, ("v", "initial_state"),
                  ("beta", "log_decay", "retention", "k", "d0"))


def vmap_main():
    """OSDN-APF (Pallas OSGM phase 1, then the Pallas core) on B rows of three packed documents
    each, ``jax.vmap`` over the rows as ``train.step`` runs packed rows, rows over data and heads
    over tensor: ``check_sharded`` (the vmapped kernel calls stay partitioned)."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    cu = jnp.asarray([0, 5, 22, 37], jnp.int32)
    x = make_inputs(1, "none", b=B, n_init=3 * B)
    del x["write_key"]
    rng = np.random.default_rng(3)
    H, K = x["k"].shape[2:]
    x["initial_state"] = x["initial_state"].reshape(B, 3, *x["initial_state"].shape[1:])
    x["retention"] = jnp.asarray(rng.uniform(0.9, 1.0, x["beta"].shape), jnp.float32)
    x["d0"] = jnp.asarray(rng.uniform(0.5, 2.0, (B, 3, H, K)), jnp.float32)
    one_row = delta_fn(cu, osdn=True)

    def row(r):
        r = {n: a if n in ("initial_state", "d0") else a[None] for n, a in r.items()}
        o, final, d_term = one_row(r)
        return o[0], final, d_term

    def fn(x):
        o, final, d_term = jax.vmap(row)(x)
        return o, final, jnp.sum(d_term)

    spec = {name: P("data", None, "tensor", *(None,) * (a.ndim - 3)) for name, a in x.items()}
    check_sharded(mesh, fixed_loss_step(fn), x, spec, ("v", "initial_state"),
                  ("beta", "retention", "k", "d0"))


def assert_matches(got, want, summed):
    """``got`` == ``want`` (both ``((loss, (out, final)), grads)`` on the host) bit for bit, except
    the gradients named in ``summed`` (sums over K or across devices, in another order): max
    relative error <= 1e-6. The loss itself is not compared (a sum in another order)."""
    (_, aux), g = got
    for name, a, b in zip(["out", "final", *g], jax.tree.leaves((aux, g)),
                          jax.tree.leaves((want[0][1], want[1]))):
        if name in summed:
            err = np.max(np.abs(a - b)) / np.max(np.abs(b))
            assert err <= 1e-6, f"d{name}: relative max error {err:.3g}"
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


def check_sharded(mesh, step, x, spec, out_names, summed):
    """``step`` (jitted value_and_grad) on one device == on inputs sharded as ``spec``; the
    outputs (named by the inputs whose sharding they keep, ``out_names``) and the gradients stay
    sharded and the compiled program has no all-gather."""
    sharded = {name: jax.device_put(a, NamedSharding(mesh, spec[name])) for name, a in x.items()}
    want = jax.device_get(step(x))
    got = step(sharded)
    (_, outs), grads = got
    for name, a in [*zip(out_names, outs), *grads.items()]:  # still sharded
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec[name]), a.ndim), (name, a.sharding)
    got = jax.device_get(got)
    np.testing.assert_allclose(got[0][0], want[0][0], rtol=1e-5)  # a sum over devices
    assert_matches(got, want, summed)
    hlo = step.lower(sharded).compile().as_text()
    assert "all-gather" not in hlo, [ln for ln in hlo.splitlines() if "all-gather" in ln][:5]
    print("ok")


def atk_main(decay):
    """atk_precondition(impl="pallas") alone (per-head or per-channel decay), batch over data and
    heads over tensor: the same checks as ``main``. Per channel at T = 256, where the default
    ``sequence_pieces`` (auto) cuts each row in two: the split's passes and chains run sharded."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    from pallas_kernels import atk_precond
    chains, real = [], atk_precond._chain
    atk_precond._chain = lambda *a, **kw: chains.append(kw.get("reverse", False)) or real(*a, **kw)
    fn, x, spec, _, summed = smap_case("atk", decay, t=256 if decay == "channel" else 21)
    check_sharded(mesh, fixed_loss_step(fn), x, spec, ("k", "initial_state"), summed)
    assert (False in chains and True in chains) == (decay == "channel"), chains


def osgm_pieces_main():
    """OSGM phase 1 by Picard sweeps over 2 sequence pieces (``osgm_precond.Options``), the token
    loops poisoned (NaN), batch over data and heads over tensor: the checks of ``main`` (all
    results as sums in another order, below), and the pieces' maps were composed each way (the
    sweep kernels chain them per shard: a piece's rows stay on its sequence's device)."""
    from pallas_kernels import osgm_precond
    from pallas_kernels.osgm_precond import Options, osgm_pallas
    composed = []
    for name in ("osgm_sweep_compose", "osgm_sweep_compose_bwd"):
        real = getattr(osgm_precond, name)
        setattr(osgm_precond, name, lambda *a, _name=name, _real=real, **kw:
                composed.append(_name) or _real(*a, **kw))
    poison_token_loops(setattr)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    x = osgm_inputs(0, b=B, t=20, n_init=B)
    options = Options(picard_iters=16, picard_block_k=8, picard_pieces=2, picard_early_exit=True)

    def fn(x):
        return osgm_pallas(x["k"], x["beta"], x["retention"], 2.0, 0.5, 2.0, True, 1e-6,
                           x["initial_state"], None, 64, options)

    bthk = P("data", None, "tensor", None)
    spec = dict(k=bthk, beta=P("data", None, "tensor"), retention=P("data", None, "tensor"),
                initial_state=P("data", "tensor", None))
    # every result within 1e-6, not bitwise: the sweeps' coupling a_t is an XLA sum over the
    # coordinate blocks, in an order XLA picks per program shape
    check_sharded(mesh, fixed_loss_step(fn), x, spec, ("k", "initial_state"),
                  ("out", "final", "beta", "retention", "k", "initial_state"))
    assert set(composed) == {"osgm_sweep_compose", "osgm_sweep_compose_bwd"}, composed


def interpret_without_vma():
    """Lower interpret-mode ``pallas_call``s on the CPU with the varying-axes types stripped: jax
    0.11.2's HLO interpreter evaluates the kernel body under shard_map's check_vma, mixing the
    kernel's constants (invariant) with blocks of varying operands ("Primitive mul requires varying
    manual axes to match"); the Triton lowering never sees those types. Test-only; values are
    unchanged."""
    from jax._src import config, core
    from jax._src.interpreters import mlir
    from jax._src.pallas import pallas_call

    def strip(avals):
        return [a.update_manual_axis_type(core.empty_mat) if isinstance(a, core.ShapedArray)
                else a for a in avals]

    def lower(ctx, *args, **params):
        ctx = ctx.replace(avals_in=strip(ctx.avals_in), avals_out=strip(ctx.avals_out))
        with config._check_vma(False):
            return pallas_call._pallas_call_lowering(ctx, *args, **params)

    mlir.register_lowering(pallas_call.pallas_call_p, lower, platform="cpu")


def smap_case(op, atk_decay="head", t=21):
    """(fn(x) -> (output, final state), inputs, their specs, the output's spec, the names of the
    gradients that are sums over K or across devices) for op = delta | osgm | atk (atk: per-head
    or per-channel decay, t tokens)."""
    bthk = P("data", None, "tensor", None)
    if op == "delta":  # dense, scalar decay, write key, initial states
        x = make_inputs(0, "scalar", b=B, n_init=B)
        spec = dict.fromkeys(x, bthk) | dict(beta=P("data", None, "tensor"),
                                            log_decay=P("data", None, "tensor"),
                                            initial_state=P("data", "tensor", None, None))

        def fn(x):
            return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["write_key"],
                                  log_decay=x["log_decay"], initial_state=x["initial_state"],
                                  output_final_state=True, impl="pallas", chunk_size=C)
        return fn, x, spec, bthk, ("beta", "log_decay")
    if op == "osgm":  # no initial state: the kernel's d_0 = 1 is invariant, k varying
        x = osgm_inputs(0, b=B)
        del x["initial_state"]
        spec = dict(k=bthk, beta=P("data", None, "tensor"), retention=P("data", None, "tensor"))

        def fn(x):
            return pla.osgm_precondition(x["k"], x["beta"], eta=0.5, retention=x["retention"],
                                         output_final_state=True, impl="pallas")
        return fn, x, spec, bthk, ("beta", "retention", "k")
    x = atk_inputs(0, b=B, t=t, h=2, n_init=B, decay=atk_decay)  # centres per head only
    spec = dict(k=bthk, log_decay=bthk if atk_decay == "channel" else P("data", None, "tensor"),
                gain=P("data", None, "tensor"), center=P("tensor"),
                initial_state=P("data", "tensor", None))

    def fn(x):
        return pla.atk_precondition(x["k"], x["log_decay"], x["gain"], x["center"],
                                    initial_state=x["initial_state"], output_final_state=True,
                                    impl="pallas")
    return fn, x, spec, bthk, ("center",)  # dcenter: a sum over batch rows, across devices


@functools.cache
def one_device(op):
    """``smap_case(op)``'s one-device run (``fixed_loss_step``) on the host."""
    fn, x, *_ = smap_case(op)
    return jax.device_get(fixed_loss_step(fn)(x))


def smap_main(op):
    """``op`` inside ``jax.shard_map`` (check_vma=True) over the (data=4, tensor=2) mesh, batch
    over data and heads over tensor: outputs, final states and the gradients of every input equal
    the one-device run (bit for bit; sums over K or across devices within 1e-6 relative)."""
    interpret_without_vma()
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    fn, x, spec, out_spec, summed = smap_case(op)
    final_spec = P("data", "tensor")
    sharded_fn = jax.shard_map(fn, mesh=mesh, in_specs=(spec,), out_specs=(out_spec, final_spec))
    assert_matches(jax.device_get(fixed_loss_step(sharded_fn)(x)), one_device(op), summed)
    print("ok")


def explicit_main(op):
    """``op`` under ``jit`` on the (data=4, tensor=2) mesh with ``Explicit`` axes (shardings in
    the types), batch over data and heads over tensor: equal to one device as in ``smap_main``,
    the gradients keep their inputs' shardings, no all-gather in the compiled program."""
    fn, x, spec, _, summed = smap_case(op)
    want = one_device(op)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        sharded = {n: jax.device_put(a, NamedSharding(mesh, spec[n])) for n, a in x.items()}
        compiled = fixed_loss_step(fn).lower(sharded).compile()
        got = compiled(sharded)
        for name, a in got[1].items():
            assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec[name]), a.ndim), name
        hlo = compiled.as_text()
    assert "all-gather" not in hlo, [ln for ln in hlo.splitlines() if "all-gather" in ln][:5]
    assert_matches(jax.device_get(got), want, summed)
    print("ok")


def run_case(case):
    if case.startswith("smap_"):
        smap_main(case[5:])
    elif case.startswith("explicit_"):
        explicit_main(case[9:])
    elif case == "vmap_packed":
        vmap_main()
    elif case == "osgm_pieces":
        osgm_pieces_main()
    elif case.startswith("atk_"):
        atk_main(case[4:])
    else:
        main(case)


if __name__ == "__main__":
    for case in sys.argv[1:]:
        run_case(case)
