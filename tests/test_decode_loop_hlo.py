"""benchmarks/decode_loop_hlo.py on the CPU: the compiled decoding loop updates its cache in
place (convolution rings, OSGM's two slots of d, one position a model), so with the layers'
XLA step (the fused kernel runs interpreted on a CPU, which copies its buffers) the loop's
body copies one array, the position."""

import pytest

from benchmarks import decode_loop_hlo as hlo
from benchmarks.bench_decode_step import decode_loop
from benchmarks.bench_generate import model_for


@pytest.mark.parametrize("preconditioner", ["none", "osgm"])
def test_the_decoding_loop_copies_only_the_position(preconditioner):
    decode, args = decode_loop(model_for("deltanet-340m", preconditioner, "off", tiny=True), 4)
    fusions, _, copies = hlo.counts(hlo.loop_body(decode.lower(*args).compile().as_text()))
    assert fusions > 0
    assert len(copies) == 1 and copies[0][1] == "s32[1]{0}", copies


def test_loop_body_wants_one_loop():
    with pytest.raises(ValueError, match="one while loop"):
        hlo.loop_body("ENTRY %main (p: f32[]) -> f32[] {\n  ROOT %p = f32[] parameter(0)\n}")
