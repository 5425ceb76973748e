"""delta_rule(impl="pallas") inside a jit over 8 fake CPU devices, run by tests/test_pallas_sharding.py.

    python tests/pallas_sharding_subprocess.py CASE   # dense_scalar, dense_vector, packed, osdn_dense,
                                                      # atk_head, atk_channel

Mesh (data=4, tensor=2); batch over data, heads over tensor (packed documents: one batch row,
heads over tensor; osdn_dense: OSDN-APF, the Pallas OSGM phase 1 then the Pallas core). Checks
that outputs, final states and all gradients equal the one-device run
and that the compiled program has no all-gather (the kernels run on each device's shard).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import precond_linattn as pla  # noqa: E402
from test_pallas_delta import make_inputs  # noqa: E402  (tests/ is this script's path)

B, C = 4, 16


def loss_fn(cu_seqlens, osdn):
    def loss(x):
        write_key = x.get("write_key")
        if osdn:
            write_key, d_final = pla.osgm_precondition(
                x["k"], x["beta"], eta=0.5, retention=x["retention"], initial_state=x["d0"],
                output_final_state=True, cu_seqlens=cu_seqlens, impl="pallas")
        o, final = pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=write_key,
                                  log_decay=x.get("log_decay"), initial_state=x["initial_state"],
                                  output_final_state=True, cu_seqlens=cu_seqlens, impl="pallas",
                                  chunk_size=C)
        extra = jnp.sum(jnp.sin(d_final)) if osdn else 0.0
        return jnp.sum(jnp.sin(3.0 * o)) + jnp.sum(final * jnp.cos(final)) + extra, (o, final)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def main(case):
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
    sharded = {name: jax.device_put(a, NamedSharding(mesh, spec[name])) for name, a in x.items()}

    step = loss_fn(cu, osdn)
    want = jax.device_get(step(x))
    got = step(sharded)
    (_, (o, final)), grads = got
    for name, a in [("v", o), ("initial_state", final), *grads.items()]:  # still sharded
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec[name]), a.ndim), (name, a.sharding)
    (loss, aux), g = jax.device_get(got)
    np.testing.assert_allclose(loss, want[0][0], rtol=1e-5)  # a sum over devices: another order
    for name, a, b in zip(["o", "final", *g], jax.tree.leaves((aux, g)),
                          jax.tree.leaves((want[0][1], want[1]))):
        if name in ("beta", "log_decay", "retention", "k", "d0"):  # sums over K or V: XLA fuses
            # them per program shape
            err = np.max(np.abs(a - b)) / np.max(np.abs(b))
            assert err <= 1e-6, f"d{name}: relative max error {err:.3g}"
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    hlo = step.lower(sharded).compile().as_text()
    assert "all-gather" not in hlo, [ln for ln in hlo.splitlines() if "all-gather" in ln][:5]
    print("ok")


def atk_main(decay):
    """atk_precondition(impl="pallas") alone (per-head or per-channel decay), batch over data and
    heads over tensor: the same checks as ``main``."""
    from test_pallas_atk import make_inputs as atk_inputs

    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    x = atk_inputs(0, b=B, t=21, h=2, n_init=B, decay=decay)

    def loss(x):
        kw, final = pla.atk_precondition(x["k"], x["log_decay"], x["gain"], x["center"],
                                         initial_state=x["initial_state"],
                                         output_final_state=True, impl="pallas")
        return jnp.sum(jnp.sin(3.0 * kw)) + jnp.sum(final * jnp.cos(final)), (kw, final)

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    spec = {name: P("data", None, "tensor", *(None,) * (a.ndim - 3)) for name, a in x.items()}
    spec["initial_state"] = P("data", "tensor", None)
    spec["center"] = P("tensor")
    sharded = {name: jax.device_put(a, NamedSharding(mesh, spec[name])) for name, a in x.items()}
    want = jax.device_get(step(x))
    got = step(sharded)
    (_, (kw, final)), grads = got
    for name, a in [("k", kw), ("initial_state", final), *grads.items()]:  # still sharded
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec[name]), a.ndim), (name, a.sharding)
    (loss, aux), g = jax.device_get(got)
    np.testing.assert_allclose(loss, want[0][0], rtol=1e-5)  # a sum over devices: another order
    for name, a, b in zip(["k_write", "final", *g], jax.tree.leaves((aux, g)),
                          jax.tree.leaves((want[0][1], want[1]))):
        if name == "center":  # summed over batch rows: across devices, in another order
            np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    hlo = step.lower(sharded).compile().as_text()
    assert "all-gather" not in hlo, [ln for ln in hlo.splitlines() if "all-gather" in ln][:5]
    print("ok")


if __name__ == "__main__":
    if sys.argv[1].startswith("atk_"):
        atk_main(sys.argv[1][4:])
    else:
        main(sys.argv[1])
