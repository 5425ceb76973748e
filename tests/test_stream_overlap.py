"""benchmarks/stream_overlap.py's ``grouped`` way: its patches put the scheduling group on the
stream calls themselves (``compute_on``'s call ops), lowered for CUDA through the kernels'
partitioned path; the ``stream`` way's calls stay without one."""

import re

import jax

from benchmarks import stream_overlap
from conftest import _lowered_for_cuda
from pallas_kernels.osgm_precond import Options, default_options, osgm_pallas

CALL = re.compile(r"call @compute_on\w*\(.*?\{mhlo\.frontend_attributes = \{([^}]*)\}")


def kernels(k, beta):
    """The public op's phase-1 kernels, not interpreted (as on a GPU)."""
    return osgm_pallas(k, beta, None, 0.003, 0.5, 2.0, True, 1e-6, None, None, 64, None, False)[0]


def stream_calls(way, backward):
    """The frontend attributes of each stream call of ``way``'s program lowered for CUDA."""
    stream_overlap.group_stream_calls()
    x = stream_overlap.make_inputs(jax.random.key(0), 1, 128, 2, 128, 64)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
    with default_options(Options(stream=1)):
        text = _lowered_for_cuda(stream_overlap.program(way, 1, backward=backward, phase=kernels),
                                 (args,))
    return CALL.findall(text)


def test_grouped_calls_carry_the_group_and_plain_stream_calls_do_not():
    grouped = stream_calls("grouped", backward=True)
    assert len(grouped) == 2, grouped  # the forward's and the backward's kernel calls
    assert all('_scheduling_group_id = "1"' in c and '_xla_stream_annotation = "1"' in c
               for c in grouped), grouped
    plain = stream_calls("stream", backward=False)
    assert len(plain) == 1 and "_scheduling_group_id" not in plain[0], plain
