"""benchmarks/stream_overlap.py's ``grouped`` and ``tupled`` ways: its patched lowering puts the
scheduling group on the stream calls themselves (``compute_on``'s call ops; ``tupled``: one
tuple-valued call), lowered for CUDA; the ``stream`` way's calls stay without one. The patch
is undone after each test."""

import re

import jax
import pytest
from jax._src import compute_on as compute_on_lib
from jax._src.interpreters import mlir

from benchmarks import stream_overlap
from conftest import _lowered_for_cuda
from pallas_kernels.osgm_precond import Options, default_options, osgm_pallas

# the frontend attributes of each compute_on call in a lowering's text (CALL.findall)
CALL = re.compile(r"call @compute_on\w*\(.*?\{mhlo\.frontend_attributes = \{([^}]*)\}")
GROUP = '_scheduling_group_id = "1"'
STREAM = '_xla_stream_annotation = "1"'


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    """The script's process-wide patch, restored at the test's end."""
    prim = compute_on_lib.compute_on_p
    monkeypatch.setitem(mlir._lowerings, prim, mlir._lowerings[prim])
    stream_overlap.group_stream_calls()


def kernels(k, beta):
    """The public op's phase-1 kernels, not interpreted (as on a GPU)."""
    return osgm_pallas(k, beta, None, 0.003, 0.5, 2.0, True, 1e-6, None, None, 64, None, False)[0]


def lowered(way, part):
    """``way``'s program (``part``) lowered for CUDA, as text."""
    x = stream_overlap.make_inputs(jax.random.key(0), 1, 128, 2, 128, 64)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    with default_options(Options(stream=1)):
        return _lowered_for_cuda(stream_overlap.program(way, 1, part, phase=kernels), (args,))


def test_grouped_calls_carry_the_group_and_plain_stream_calls_do_not():
    """``backward``: the backward's call in the group, the forward's outside it; ``forward``:
    the forward's call in it; ``stream``: no group anywhere."""
    forward, backward = CALL.findall(lowered("grouped", "backward"))
    assert GROUP in backward and STREAM in backward
    assert "_scheduling_group_id" not in forward and STREAM in forward
    assert [GROUP in c for c in CALL.findall(lowered("grouped", "forward"))] == [True]
    plain = CALL.findall(lowered("stream", "backward"))
    assert len(plain) == 2 and not any("_scheduling_group_id" in c for c in plain), plain


def test_tupled_calls_return_one_tuple_and_keep_their_attributes():
    """``tupled``: the grouped stream call is a call of a wrapper returning one tuple (its
    results taken apart outside the call, without stream attributes); the forward's call,
    outside the group, keeps its several results."""
    text = lowered("tupled", "backward")
    wrapped = re.findall(r"= call @(stream_tuple\w*)\(.*?\) \{mhlo\.frontend_attributes = "
                         r"\{([^}]*)\}\} : \(.*?\) -> tuple<", text)
    assert len(wrapped) == 1 and GROUP in wrapped[0][1] and STREAM in wrapped[0][1], wrapped
    body = re.search(rf"func\.func private @{wrapped[0][0]}\(.*?\n  \}}", text, re.S).group(0)
    assert re.search(r"call @compute_on\w*\(", body) and "stablehlo.tuple" in body
    assert "get_tuple_element" in text and len(CALL.findall(text)) == 1
