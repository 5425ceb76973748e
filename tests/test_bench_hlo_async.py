"""benchmarks/hlo_async.py finds what runs while an asynchronous call is in flight."""

from benchmarks import hlo_async

MODULE = """HloModule m, is_scheduled=true

%phase (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%outer (o: f32[4]) -> f32[4] {
  %o = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} call(%o), to_apply=%phase
}

%fused_add (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %s = f32[4]{0} add(%a, %a)
}

ENTRY %main (x: f32[4], y: f32[4]) -> (f32[4], f32[4], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  %call-start = (f32[4]{0}) call-start(%x), to_apply=%phase, frontend_attributes={_xla_stream_annotation="1"}
  %fusion = f32[4]{0} fusion(%y), kind=kLoop, calls=%fused_add
  %gte = f32[4]{0} get-tuple-element(%fusion), index=0
  %call-done = f32[4]{0} call-done(%call-start), frontend_attributes={_xla_stream_annotation="1"}
  %call-start.2 = ((f32[4]{0}), f32[4]{0}) call-start(%y), to_apply=%outer
  %call-start.1 = ((f32[4]{0}), f32[4]{0}) call-start(%y), to_apply=%phase
  %call-done.1 = f32[4]{0} call-done(%call-start.1)
  %call-done.2 = f32[4]{0} call-done(%call-start.2)
  ROOT %t = (f32[4]{0}, f32[4]{0}, f32[4]{0}) tuple(%call-done, %call-done.1, %fusion)
}
"""


def test_pairs_and_what_runs_beside_them(tmp_path, capsys):
    """The first pair has a fusion launched inside it (the get-tuple-element launches
    nothing), the second nothing, the third only the second (a nested pair is no work beside
    it); the report counts the last two as alone."""
    pairs = hlo_async.in_flight(MODULE)
    assert [(c, s, r, len(b)) for c, s, r, b, _ in pairs] == [
        ("main", "call-start", "phase", 2), ("main", "call-start.1", "phase", 0),
        ("main", "call-start.2", "outer", 2)]
    assert pairs[0][4] == '_xla_stream_annotation="1"' and pairs[1][4] == ""
    assert hlo_async.summary(pairs[0][3]) == {"fusion:fused_add": 1}
    assert hlo_async.summary(pairs[1][3]) == {} == hlo_async.summary(pairs[2][3])
    path = tmp_path / "m.hlo.txt"
    path.write_text(MODULE)
    hlo_async.main([str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 asynchronous pairs, 2 with nothing launched while in flight"
    assert out[1] == ("main: call-start (phase) [_xla_stream_annotation=\"1\"]: 2 between "
                      "{'fusion:fused_add': 1}")
