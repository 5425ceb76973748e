"""The XLA flags the training entry points set before JAX's backend starts.

XLA's command buffers (CUDA graphs) replay a step's kernels as graphs. Each step's batch and
temporaries sit at new addresses, so the graphs are updated before they launch: at the 340M
shape on an H200 that is a ~9 ms gap before every step's first kernel, and the step runs 12 %
faster without them (114.6 against 127.9 ms, 143.0k against 128.0k tokens/s;
``benchmarks/RESULTS.md`` runs 100 and 104). A host-bound step (a small model, one row) is
the exception: there the graphs save launches (7.8 against 12.4 ms a step, run 101), so the
training CLI's ``--command-buffers`` keeps them. On a CPU the flag changes nothing.
"""

import os

from jax._src import xla_bridge

COMMAND_BUFFER = "--xla_gpu_enable_command_buffer"


def with_command_buffers(flags: str, enabled: bool) -> str:
    """``flags`` (an ``XLA_FLAGS`` string) with ``--xla_gpu_enable_command_buffer=`` (an empty
    list of command buffer kinds) appended when ``enabled`` is false, unless ``flags`` sets that
    flag already (the user's own choice wins)."""
    if enabled or any(f.split("=")[0] == COMMAND_BUFFER for f in flags.split()):
        return flags
    return f"{flags} {COMMAND_BUFFER}=".strip()


def set_command_buffers(enabled: bool) -> bool:
    """Sets this process's ``XLA_FLAGS`` by ``with_command_buffers``. XLA reads them once, when
    the backend starts: returns False (and changes nothing) when it has started already."""
    if xla_bridge.backends_are_initialized():
        return False
    flags = with_command_buffers(os.environ.get("XLA_FLAGS", ""), enabled)
    if flags:
        os.environ["XLA_FLAGS"] = flags
    return True
