"""delta_rule(impl="pallas") inside a jit over a device mesh: batch and heads stay sharded.

Each case runs tests/pallas_sharding_subprocess.py in a fresh process on 8 fake CPU devices (the
device count must be set before jax is imported)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case", ["dense_scalar", "dense_vector", "packed", "osdn_dense",
                                  "atk_head", "atk_channel"])
def test_sharded_equals_one_device(case):
    """Mesh (data=4, tensor=2): outputs, final states and gradients equal the one-device run,
    stay sharded, and the compiled program has no all-gather."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    script = ROOT / "tests" / "pallas_sharding_subprocess.py"
    done = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
