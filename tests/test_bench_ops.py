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


def test_against_fp32_matches_cotangents_and_names_the_used_inputs(little_poison):
    """The fp32 section's bf16 errors are bf16-sized (one set of cotangents for all three runs:
    unmatched ones give errors of order one) and name exactly the model's inputs."""
    import jax
    import jax.numpy as jnp
    x = bench_ops.inputs(jax.random.key(3), 1, 40, 2, 32, "deltanet", jnp.bfloat16)
    r = bench_ops.against_fp32("osdn-apf", "osgm_apf", "chunked", x, jax.random.key(4))
    errs = r["chunked bf16"]
    assert set(errs) == {"o", "final", "q", "k", "v", "beta", "r"}
    assert all(1e-4 < e < 2e-2 for e in errs.values()), errs


def test_saved_fp32_record_replays_the_chunked_errors(little_poison, tmp_path):
    """``--save-fp32``'s record holds the whole problem: its inputs and cotangents through the
    chunked bf16 form (as FLA's process runs them, ``bench_fla.against``) give back the errors
    the section measured, and through the chunked fp32 form the record's fp32 answer."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from benchmarks import fp32_record
    x = bench_ops.inputs(jax.random.key(5), 1, 40, 2, 32, "gdn", jnp.bfloat16)
    r = bench_ops.against_fp32("gdn", "none", "chunked", x, jax.random.key(6), tmp_path)
    rec = fp32_record.load(tmp_path / "gdn.npz")
    assert rec["model"] == "gdn" and set(rec["x"]) == set(rec["grads"]) == {
        "q", "k", "v", "beta", "g"}
    assert rec["errors"]["chunked bf16"] == r["chunked bf16"]

    def replay(dtype):
        xs = {n: jnp.asarray(a, jnp.float32 if n == "g" else dtype) for n, a in rec["x"].items()}
        (o, final), pullback = jax.vjp(bench_ops.composed("none", "chunked"), xs)
        return o, final, pullback((jnp.asarray(rec["ct_o"], o.dtype),
                                   jnp.asarray(rec["ct_final"])))[0]

    o, final, grads = jax.jit(replay, static_argnums=0)(jnp.float32)
    np.testing.assert_allclose(o, rec["ref_o"], rtol=1e-5, atol=1e-6)
    for n in rec["grads"]:
        np.testing.assert_allclose(grads[n], rec["grads"][n], rtol=1e-4, atol=1e-5, err_msg=n)
    errs = fp32_record.errors(*jax.jit(replay, static_argnums=0)(jnp.bfloat16), rec["ref_o"],
                              rec["ref_final"], rec["grads"])
    np.testing.assert_allclose([errs[n] for n in sorted(errs)],
                               [r["chunked bf16"][n] for n in sorted(errs)], rtol=2e-3)
