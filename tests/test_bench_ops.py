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
