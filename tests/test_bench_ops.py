"""bench_ops on the CPU: what its ATK phase rows run."""

from benchmarks import bench_ops
from pallas_kernels import atk_precond


def test_atk_phase_entries_choose_the_kernels(monkeypatch):
    """Each ``--atk-pieces`` entry reaches ``atk_pallas`` as its options: Triton pieces (a count
    or "auto"), the Mosaic kernels on one warpgroup or ("mosaic2") on two."""
    seen = []
    monkeypatch.setattr(atk_precond, "atk_pallas", lambda *args: seen.append(args[-1]))
    x = dict(k=None, gp=None, bp=None, c=None)
    for entry in ("4", "auto", "mosaic", "mosaic2"):
        bench_ops.atk_phase(entry)(x)
    assert [(o.mosaic, o.sequence_pieces, o.mosaic_warpgroups) for o in seen] == [
        (False, 4, 1), (False, None, 1), (True, None, 1), (True, None, 2)]


def test_against_fp32_matches_cotangents_and_names_the_used_inputs(monkeypatch):
    """The fp32 section's bf16 errors are bf16-sized (one set of cotangents for all three runs:
    unmatched ones give errors of order one) and name exactly the model's inputs."""
    import jax
    import jax.numpy as jnp
    from benchmarks import bench_delta
    monkeypatch.setattr(bench_delta, "POISON_GIB", [0.01])  # not the device's 4 GiB of NaN
    x = bench_ops.inputs(jax.random.key(3), 1, 40, 2, 32, "deltanet", jnp.bfloat16)
    r = bench_ops.against_fp32("osdn-apf", "osgm_apf", "chunked", x, jax.random.key(4))
    errs = r["chunked bf16"]
    assert set(errs) == {"o", "final", "q", "k", "v", "beta", "r"}
    assert all(1e-4 < e < 2e-2 for e in errs.values()), errs
