"""delta_rule(impl="pallas") inside a jit over a device mesh: batch and heads stay sharded; the
Pallas operations inside ``jax.shard_map`` (check_vma=True) and on meshes with Explicit axes run
on the local shards.

Each test runs tests/pallas_sharding_subprocess.py on a group of its cases in a fresh process on
8 fake CPU devices (the device count must be set before jax is imported); it prints "ok" after
each case whose checks pass. Grouped, the cases share the process's start and an op's shard_map
and Explicit cases its one-device run (the suite's time)."""

import pytest

from conftest import ROOT, run_python

SCRIPT = ROOT / "tests" / "pallas_sharding_subprocess.py"


@pytest.mark.heavy
@pytest.mark.parametrize("cases", [
    ["dense_scalar", "dense_vector", "packed", "explicit_delta", "smap_delta"],
    ["osdn_dense", "vmap_packed", "osgm_pieces"],  # osgm_pieces last: it poisons the token loops
    ["explicit_osgm", "smap_osgm"],
    ["atk_head", "atk_channel", "explicit_atk", "smap_atk"]],
    ids=["delta", "osdn", "osgm", "atk"])
def test_on_a_mesh_equals_one_device(cases):
    """Each case, on mesh (data=4, tensor=2):

    - dense_*, packed, osdn_dense, vmap_packed, atk_*, osgm_pieces (jit, Auto axes): outputs,
      final states and gradients equal the one-device run, stay sharded, and the compiled
      program has no all-gather (vmap_packed: OSDN on vmapped rows of packed documents, as the
      train step runs them; osgm_pieces: OSGM by Picard sweeps over sequence pieces);
    - smap_*: delta_rule (dense, scalar decay), osgm_precondition (no initial state: an
      invariant d_0) and atk_precondition (centres invariant over the batch axis) inside
      ``jax.shard_map`` with check_vma=True: outputs, final states and the gradients of every
      input equal the one-device run;
    - explicit_*: the same ops under ``jit`` on a mesh with ``Explicit`` axes (shardings in the
      types): equal to one device, gradients keep their inputs' shardings, no all-gather.

    The smap_* cases come last in their group: they lower the kernels with the varying-axes
    types stripped from then on."""
    done = run_python(SCRIPT, *cases, timeout=400, ends_with="ok")
    assert done.stdout.split().count("ok") == len(cases), done.stdout
