"""delta_rule(impl="pallas") inside a jit over a device mesh: batch and heads stay sharded; the
Pallas operations inside ``jax.shard_map`` (check_vma=True) and on meshes with Explicit axes run
on the local shards.

Each case runs tests/pallas_sharding_subprocess.py in a fresh process on 8 fake CPU devices (the
device count must be set before jax is imported); it prints "ok" when its checks pass."""

import pytest

from conftest import ROOT, run_python

SCRIPT = ROOT / "tests" / "pallas_sharding_subprocess.py"


@pytest.mark.parametrize("case", ["dense_scalar", "dense_vector", "packed", "osdn_dense",
                                  "vmap_packed", "atk_head", "atk_channel", "osgm_pieces"])
def test_sharded_equals_one_device(case):
    """Mesh (data=4, tensor=2): outputs, final states and gradients equal the one-device run,
    stay sharded, and the compiled program has no all-gather (vmap_packed: OSDN on vmapped rows
    of packed documents, as the train step runs them; osgm_pieces: OSGM by Picard sweeps over
    sequence pieces)."""
    run_python(SCRIPT, case, timeout=120, ends_with="ok")


@pytest.mark.parametrize("op", ["delta", "osgm", "atk"])
def test_shard_map_equals_one_device(op):
    """delta_rule (dense, scalar decay), osgm_precondition (no initial state: an invariant d_0)
    and atk_precondition (centres invariant over the batch axis) inside ``jax.shard_map`` with
    check_vma=True on mesh (data=4, tensor=2): outputs, final states and the gradients of every
    input equal the one-device run."""
    run_python(SCRIPT, f"smap_{op}", timeout=120, ends_with="ok")


@pytest.mark.parametrize("op", ["delta", "osgm", "atk"])
def test_explicit_mesh_equals_one_device(op):
    """The same ops under ``jit`` on a mesh with ``Explicit`` axes (shardings in the types):
    equal to one device, gradients keep their inputs' shardings, no all-gather."""
    run_python(SCRIPT, f"explicit_{op}", timeout=120, ends_with="ok")
