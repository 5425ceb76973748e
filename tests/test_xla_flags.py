"""The training entry points' XLA flags: command buffers off unless asked for or set by the user."""

import pytest

from train.xla_flags import with_command_buffers
from conftest import FAST_COMPILE, run_python

OFF = "--xla_gpu_enable_command_buffer="


@pytest.mark.parametrize("flags, enabled, expected", [
    ("", False, OFF),
    ("--xla_force_host_platform_device_count=8", False, f"--xla_force_host_platform_device_count=8 {OFF}"),
    ("", True, ""),
    ("--xla_force_host_platform_device_count=8", True, "--xla_force_host_platform_device_count=8"),
    ("--xla_gpu_enable_command_buffer=FUSION", False, "--xla_gpu_enable_command_buffer=FUSION"),
    (f"--a=1 {OFF} --b=2", False, f"--a=1 {OFF} --b=2"),
    ("--xla_gpu_enable_command_buffer_x=1", False, f"--xla_gpu_enable_command_buffer_x=1 {OFF}"),
])
def test_with_command_buffers(flags, enabled, expected):
    assert with_command_buffers(flags, enabled) == expected


def test_set_command_buffers_only_before_the_backend_starts():
    """In a fresh process the flag lands in XLA_FLAGS (and XLA accepts it on a CPU); once the
    backend runs, the call says it could not take effect and leaves XLA_FLAGS alone."""
    script = ("import os, jax; from train.xla_flags import set_command_buffers as s\n"
              "print(s(False), os.environ['XLA_FLAGS']); jax.numpy.ones(2).block_until_ready()\n"
              "os.environ['XLA_FLAGS'] = 'x'; print(s(False), os.environ['XLA_FLAGS'])")
    lines = run_python("-c", script, devices=1, timeout=120).stdout.split("\n")
    assert lines[0] == f"True {FAST_COMPILE} --xla_force_host_platform_device_count=1 {OFF}"
    assert lines[1] == "False x"
