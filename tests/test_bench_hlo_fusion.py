"""benchmarks/hlo_fusion.py reads a compiled program's HLO (here one compiled on the CPU)."""

import inspect
import os

import jax
import jax.numpy as jnp

from benchmarks import hlo_fusion


def _joined(x, y):
    return jnp.concatenate([jnp.sin(x), y.T], axis=1)


def _step(x, y):
    return (_joined(x, y).T * 2.0).sum(0)


def test_a_fusion_points_at_the_lines_that_made_it(tmp_path, capsys):
    """The fusion holding the concatenation, named as a profile names it (its number after an
    underscore): its operands, its instructions with their layouts, and each instruction's
    innermost Python frames (the concatenation's line, then its caller's)."""
    text = jax.jit(_step).lower(jnp.ones((64, 32)), jnp.ones((16, 64))).compile().as_text()
    comps, _ = hlo_fusion.parse(text)
    fusions = [i[0] for insts in comps.values() for i in insts if i[2] == "fusion"
               and any(s[2] == "concatenate" for s in comps.get(hlo_fusion.called(i), []))]
    assert len(fusions) == 1
    name = fusions[0].replace(".", "_")
    path = tmp_path / "step.hlo.txt"
    path.write_text(text)
    hlo_fusion.main([str(path), name, "no_such_fusion_3", "--frames", "2"])
    out = capsys.readouterr().out.splitlines()
    here = os.path.relpath(__file__)
    concat_line = inspect.getsourcelines(_joined)[1] + 1
    caller_line = inspect.getsourcelines(_step)[1] + 1
    assert out[0].startswith(f"{fusions[0]} = f32[") and out[0].endswith(" fusion")
    assert {line.split(":")[0].strip() for line in out if "operand" in line} == {
        "operand x.1", "operand y.1"}
    concat = [line for line in out if line.strip().startswith("concatenate")]
    assert len(concat) == 1
    assert f"[{here}:{concat_line} _joined; {here}:{caller_line} _step]" in concat[0]
    assert any(line.strip().startswith("transpose") and "{0,1}" in line for line in out)
    assert out[-1] == "no_such_fusion_3: no such instruction"


def test_a_name_without_its_number_takes_the_whole_kind():
    """``loop_add_fusion`` lists every instruction of that kind (with and without a number);
    ``loop_add_fusion_4`` (the profile's spelling) and ``loop_add_fusion.4`` only that one."""
    text = "\n".join([
        "ENTRY %main (p: f32[4]) -> f32[4] {",
        "  %p = f32[4]{0} parameter(0)",
        "  %loop_add_fusion = f32[4]{0} fusion(%p), kind=kLoop, calls=%c",
        "  %loop_add_fusion.4 = f32[4]{0} fusion(%loop_add_fusion), kind=kLoop, calls=%c",
        "  ROOT %loop_add_fusion.41 = (f32[4]{0}, f32[4]{0}) fusion(%p), kind=kLoop, calls=%c",
        "}"])
    heads = lambda name: [line.split(" = ")[0] for line in hlo_fusion.describe(text, [name])
                          if " = " in line]
    assert heads("loop_add_fusion") == ["loop_add_fusion", "loop_add_fusion.4",
                                        "loop_add_fusion.41"]
    assert heads("loop_add_fusion_4") == heads("loop_add_fusion.4") == ["loop_add_fusion.4"]
    assert hlo_fusion.describe(text, ["loop_add_fusion.41"])[0] == (
        "loop_add_fusion.41 = (f32[4]{0}, f32[4]{0}) fusion")
