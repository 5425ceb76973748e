"""The reading of Mosaic GPU profiler traces (benchmarks/profile_mosaic.py) and the switch that
turns the profiler on (``state_mosaic.profiled``)."""

import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.profile_mosaic import kernel_of, region_times, summary
from pallas_kernels import state_mosaic


def events(tid, spans):
    """B / E events of ``spans`` [(name, start, end)] (nested ones inside their parents)."""
    marks = [(start, 0, name) for name, start, end in spans] + [(end, 1, name)
                                                               for name, start, end in spans]
    # at equal times an end closes before a begin opens, the inner region closing first
    out = []
    for ts, is_end, name in sorted(marks, key=lambda m: (m[0], -m[1])):
        out.append(dict(name=name, ph="E" if is_end else "B", ts=float(ts), pid=1, tid=tid))
    return out


def test_region_times_and_summary():
    """Two CTAs: per region the count, total and mean an occurrence averaged over them, the
    span from each CTA's first to last event, the nested region measured on its own."""
    one = events(1, [("wait_in", 0, 1), ("sweep", 1, 4), ("row_sums", 4, 5), ("sweep", 5, 7),
                     ("emit", 7, 10)])
    two = events(2, [("wait_in", 100, 103), ("sweep", 103, 104), ("emit", 104, 110),
                     ("inner", 105, 106)])
    per_cta = region_times(one + two)
    assert per_cta[1][0]["sweep"] == [3.0, 2.0] and per_cta[1][1] == 10.0
    assert per_cta[2][0]["inner"] == [1.0] and per_cta[2][1] == 10.0
    rows, span = summary(per_cta)
    by_name = {r[0]: r[1:] for r in rows}
    assert span == 10.0
    assert by_name["sweep"] == pytest.approx((1.5, 3.0, 2.0, 0.3))
    assert by_name["emit"] == pytest.approx((1.0, 4.5, 4.5, 0.45))
    assert by_name["row_sums"] == pytest.approx((0.5, 0.5, 1.0, 0.05))
    assert rows[0][0] == "emit"  # longest total first
    assert kernel_of(set(by_name)) == "osgm_fwd"
    assert kernel_of({"gradients", "emit"}) == "osgm_bwd" and kernel_of({"x"}) == "?"


def test_region_times_refuses_crossed_regions():
    crossed = [dict(name="a", ph="B", ts=0.0, tid=1), dict(name="b", ph="B", ts=1.0, tid=1),
               dict(name="a", ph="E", ts=2.0, tid=1)]
    with pytest.raises(ValueError, match="'a' closes 'b'"):
        region_times(crossed)


def test_profiled_sets_the_compiler_params(monkeypatch):
    """Inside ``profiled`` a GPU kernel gets the profiler's directory and space (bounds
    checked); outside it and in interpret mode none. JAX's caches are cleared as it opens and
    closes (a cached lowering would not follow the switch)."""
    seen, cleared = [], []
    monkeypatch.setattr(state_mosaic.jax, "clear_caches", lambda: cleared.append(len(seen)))

    def fake_kernel(body, *, compiler_params, **kw):
        seen.append(compiler_params)
        return lambda *args: None

    monkeypatch.setattr(state_mosaic.plgpu, "kernel", fake_kernel)
    build = dict(name="k", out_type=(), scratch={}, grid=(1,), grid_names=("b",))
    with state_mosaic.profiled("/tmp/traces", 77):
        state_mosaic.kernel(None, interpret=False, **build)
        state_mosaic.kernel(None, interpret=True, **build)
    state_mosaic.kernel(None, interpret=False, **build)
    assert (seen[0].profile_dir, seen[0].profile_space, seen[0].profile_bounds_check) == (
        "/tmp/traces", 77, True)
    assert [p.profile_space for p in seen[1:]] == [0, 0]
    assert all(isinstance(p, plgpu.CompilerParams) for p in seen)
    assert cleared == [0, 2]
