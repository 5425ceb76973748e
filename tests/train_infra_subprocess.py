"""Checks of train/ that need their own process, run by tests/test_train_infra.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/train_infra_subprocess.py MODE DIR

MODE sharding: a (2, 2, 2) mesh over the 8 fake CPU devices; sigterm: SIGTERM mid-run: save, then
a clean exit.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from train.checkpoint import Checkpointer
from train.config import CheckpointConfig
from train.sharding import init_sharded, logical_sharding, make_mesh, state_shardings, use_mesh


class Toy(nnx.Module):
    """Embedding ("vocab", "embed"), an MLP ("embed", "mlp") / ("mlp", "embed") and a gate (H,)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.1)
        self.embed = nnx.Param(init(rngs.params(), (16, 8)), out_sharding=("vocab", "embed"))
        self.up = nnx.Param(init(rngs.params(), (8, 12)), out_sharding=("embed", "mlp"))
        self.down = nnx.Param(init(rngs.params(), (12, 8)), out_sharding=("mlp", "embed"))
        self.A_log = nnx.Param(jnp.zeros((4,)))

    def __call__(self, tokens):
        h = self.embed[tokens]
        return jnp.mean((h + jax.nn.silu(h @ self.up) @ self.down) ** 2) + jnp.sum(self.A_log**2)


def make():
    model = Toy(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def sharding(directory):
    mesh = make_mesh(2, 2, 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    model, opt = init_sharded(make, mesh)
    expect = {"embed": (P("tensor", "fsdp"), (8, 4)), "up": (P("fsdp", "tensor"), (4, 6)),
              "down": (P("tensor", "fsdp"), (6, 4)), "A_log": (P(), (4,))}
    for name, (spec, shard_shape) in expect.items():
        value = getattr(model, name)[...]
        assert value.sharding.spec == spec, (name, value.sharding)
        assert value.addressable_shards[0].data.shape == shard_shape, (name, value.addressable_shards[0])
    assert opt.opt_state[0].mu["up"][...].sharding.spec == P("fsdp", "tensor")

    tokens = jax.device_put(np.arange(32).reshape(8, 4) % 16, logical_sharding(mesh, ("batch", "seq")))
    assert tokens.addressable_shards[0].data.shape == (2, 4)  # batch over data × fsdp
    with nnx.use_eager_sharding(False):  # the same model, unsharded
        reference = jax.jit(lambda m, t: m(t))(Toy(nnx.Rngs(0)), np.asarray(tokens))

    @nnx.jit
    def step(model, opt, tokens):
        loss, grads = nnx.value_and_grad(lambda m: m(tokens))(model)
        opt.update(model, grads)
        return loss

    with use_mesh(mesh):
        loss = step(model, opt, tokens)
    np.testing.assert_allclose(loss, reference, rtol=1e-6)
    assert model.up[...].sharding.spec == P("fsdp", "tensor")

    # A sharded checkpoint restores with the shardings of the target.
    state, opt_state = nnx.state(model), nnx.state(opt)
    with Checkpointer(CheckpointConfig(dir=directory, every=1, keep=1)) as ck:
        ck.save(1, model=state, opt=opt_state, rng=jax.random.key(0))
        ck.wait()
        restored = ck.restore(model=state_shardings_target(state, mesh), opt=opt_state)
    assert restored.model["up"][...].sharding.spec == P("fsdp", "tensor")
    np.testing.assert_array_equal(restored.model["up"][...], state["up"][...])
    print("ok")


def state_shardings_target(state, mesh):
    """Abstract arrays carrying the shardings the rules give (what a resumed run passes)."""
    shardings = state_shardings(state, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def sigterm(directory):
    with Checkpointer(CheckpointConfig(dir=directory, every=100, keep=2)) as ck:
        params = {"w": jnp.zeros(3)}
        for step in range(1, 50):
            params = {"w": params["w"] + 1}
            if step == 3:
                os.kill(os.getpid(), 15)  # SIGTERM: the handler only sets a flag
            if ck.should_save(step, last=step == 49):
                ck.save(step, model=params, opt=params, rng=jax.random.key(step))
            if ck.stop_requested:
                break
    print(f"stopped at {step}")


if __name__ == "__main__":
    {"sharding": sharding, "sigterm": sigterm}[sys.argv[1]](sys.argv[2])
