"""Shared test helpers: random inputs (never zeros), error measures and the checks the kernel
tests share, and a runner for the scripts that need their own process.

Test files and the subprocess scripts import it as ``conftest`` (pytest puts tests/ on sys.path;
a script's own folder is on it too), the module pytest itself loaded."""

import functools
import os
import shlex
import subprocess
import sys
import zlib
from pathlib import Path

# XLA:CPU compiles the tests' programs with LLVM at -O0: they are tiny, so compiling is most of
# the suite's time (-30 %); the HLO passes (partitioning, fusion) are those of any other run.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _interpreter_callbacks_take_host_arrays():
    """Mosaic GPU's interpret mode runs every shared-memory access, copy and barrier of a kernel
    as an ``io_callback`` into its interpreter, and ``io_callback``'s implementation first
    ``device_put``s the arguments XLA hands it (already host numpy arrays, ~11 a callback):
    ~1.1 ms a callback, half of an interpret-mode kernel test's time (cProfile of
    test_pallas_osgm_mosaic's reference test: 18,745 callbacks, 43 of its 50 s, 27 s of them in
    ``device_put``). The interpreter's own callbacks take the arrays as numpy arrays, scalars (its
    ids and indices) as Python numbers; every other callback keeps JAX's implementation."""
    from jax._src import callback as callback_module

    real = callback_module.io_callback_impl
    cpu = jax.local_devices(backend="cpu")[0]

    def impl(*args, result_avals, callback, sharding, ordered):
        f = callback.callback_func
        while isinstance(f, functools.partial):
            f = f.func
        if not getattr(f, "__module__", "").startswith("jax._src.pallas.mosaic_gpu.interpret"):
            return real(*args, result_avals=result_avals, callback=callback, sharding=sharding,
                        ordered=ordered)
        args = [a.item() if np.ndim(a) == 0 else a for a in args]  # scalars: ids, indices
        with jax.default_device(cpu):
            return jax.tree.map(np.asarray, callback(*args))

    callback_module.io_callback_impl = impl


_interpreter_callbacks_take_host_arrays()


def pytest_collection_modifyitems(items):
    """Tests marked ``heavy`` first, the rest in their order: with ``-n 2`` a heavy test collected
    last would leave one worker running it alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def rel_err(a, b):
    """max |a − b| / max |b| in float64 numpy."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


class Rand:
    """Random draws for delta-rule inputs, seeded per test."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape, dtype=jnp.float32):
        return jnp.asarray(self.rng.standard_normal(shape), dtype)

    def unit(self, *shape, dtype=jnp.float32):
        x = self.rng.standard_normal(shape)
        return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), dtype)

    def beta(self, *shape, dtype=jnp.float32):
        return jnp.asarray(self.rng.uniform(0.05, 0.95, shape), dtype)

    def log_decay(self, kind, B, T, H, K, dtype=jnp.float32):
        """None, a scalar [B,T,H] or per-channel [B,T,H,K] log decay in [-1.5, -0.01]."""
        if kind is None:
            return None
        shape = (B, T, H) if kind == "scalar" else (B, T, H, K)
        return jnp.asarray(-self.rng.uniform(0.01, 1.5, shape), dtype)

    def delta_inputs(self, B, T, H, K, V, decay=None, dtype=jnp.float32):
        return dict(q=self.unit(B, T, H, K, dtype=dtype), k=self.unit(B, T, H, K, dtype=dtype),
                    v=self.normal(B, T, H, V, dtype=dtype), beta=self.beta(B, T, H, dtype=dtype),
                    write_key=self.unit(B, T, H, K, dtype=dtype) * 1.3,
                    log_decay=self.log_decay(decay, B, T, H, K, dtype))


@pytest.fixture
def rand(request):
    return Rand(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def little_poison(monkeypatch):
    """``bench_delta.values_and_grads`` fills 0.01 GiB with NaN before a run, not the device's
    4 GiB (seconds of a CPU test)."""
    from benchmarks import bench_delta
    monkeypatch.setattr(bench_delta, "POISON_GIB", [0.01])


@pytest.fixture(autouse=True)
def _traces_see_patches(request):
    """A test that monkeypatches starts and ends with ``jax.clear_caches()``: ``jit`` caches
    traces by function, static arguments and shapes, not by the module functions they called,
    and the ops' kernels are traced under ``partition.lowered_once``'s ``jit``. Without it a
    patch (a counter, a poisoned kernel) is skipped when an earlier test traced the same op
    and shapes, and a trace made under a patch is reused after it."""
    patched = "monkeypatch" in request.fixturenames
    if patched:
        jax.clear_caches()
    yield
    if patched:
        jax.clear_caches()


def packed_cu_seqlens(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def fixed_loss_step(f):
    """``jit(value_and_grad(L, has_aux=True))`` of a fixed nonlinear loss of ``f``'s results.

    f(x) -> (o, S) or (o, S, extra): L(x) = Σ sin(3·o) + Σ S ⊙ cos(S) (+ extra, a scalar), o taken
    in float32, so the gradients pull the random-looking cotangents 3 cos(3o) and cos S − S sin S
    back to every input of x. The jitted function returns ((L, (o, S)), dL/dx)."""

    def loss(x):
        o, final, *extra = f(x)
        o = o.astype(jnp.float32)
        return sum(extra, jnp.sum(jnp.sin(3.0 * o)) + jnp.sum(final * jnp.cos(final))), (o, final)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def fixed_loss_run(f, x):
    """(o, S, dL/dx) of ``fixed_loss_step(f)`` at x."""
    (_, (o, final)), grads = fixed_loss_step(f)(x)
    return o, final, grads


def jitted_vjp(f, *args):
    """``jax.vjp(f, *args)`` with the forward and the pullback each run as one jitted program (op
    by op, every primitive of a plain-JAX reference compiles on its own: most of a test's time)."""
    pullback = jax.jit(lambda args, cts: jax.vjp(f, *args)[1](cts))
    return jax.jit(f)(*args), lambda cts: pullback(args, cts)


def assert_close(actual, expected, tol, name):
    """``actual`` is finite and rel_err(actual, expected) <= tol."""
    assert np.all(np.isfinite(np.asarray(actual, np.float64))), name
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative max error {err:.3g} > {tol}"


def assert_runs_match(got, want, tol, grads=None):
    """Two ``fixed_loss_run`` results (o, S, dL/dx) agree: o, S and the gradients named in
    ``grads`` (default: all of ``want``'s) by ``assert_close`` at ``tol``, each gradient in the
    dtype of ``want``'s."""
    assert_close(got[0], want[0], tol, "output")
    assert_close(got[1], want[1], tol, "final state")
    for name in want[2] if grads is None else grads:
        assert got[2][name].dtype == want[2][name].dtype, name
        assert_close(got[2][name], want[2][name], tol, f"d{name}")


def assert_repeats_bitwise(run):
    """Two calls of ``run()`` (compiling afresh each time) give the same leaves bit for bit."""
    first, second = run(), run()
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)


def assert_vmap_matches_loop(f, args):
    """``jit(vmap(f))(*args)`` == f on each slice of the leading axis of ``args``, stacked
    (rtol 1e-5, atol 1e-6); f returns a tuple of arrays."""
    per_row = jax.jit(jax.vmap(f))(*args)
    one_row = jax.jit(f)  # compiled once for every slice
    looped = [one_row(*[a[i] for a in args]) for i in range(len(args[0]))]
    for got, want in zip(per_row, zip(*looped)):
        np.testing.assert_allclose(got, jnp.stack(want), rtol=1e-5, atol=1e-6)


def _lowered_for_cuda(fn, args):
    """The text of ``jax.jit(fn)`` lowered for CUDA on this CPU (an abstract H100 mesh)."""
    from jax.sharding import AbstractDevice, AbstractMesh
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernels_lowered_for_cuda(loss, args, grad=True):
    """How many Triton kernels ``jax.grad(loss)`` over all of ``args`` (ShapeDtypeStructs; without
    ``grad``, ``loss`` itself) holds once lowered for CUDA on this CPU (an abstract H100 mesh;
    PTX and ptxas are not reached)."""
    fn = jax.grad(loss, argnums=tuple(range(len(args)))) if grad else loss
    return _lowered_for_cuda(fn, args).count("__gpu$xla.gpu.triton")


def mosaic_kernels_lowered_for_cuda(fn, args):
    """How many Mosaic GPU kernels ``fn`` over ``args`` (ShapeDtypeStructs) holds once lowered for
    CUDA on this CPU: Mosaic GPU's own passes run (its layout inference among them, which
    interpret mode skips); PTX and ptxas are not reached."""
    return _lowered_for_cuda(fn, args).count("custom_call @mosaic_gpu")


def run_python(*args, timeout, devices=8, ends_with=None):
    """Runs ``python *args`` in a fresh process from the repository root, the repository on
    PYTHONPATH and XLA_FLAGS forcing ``devices`` fake CPU devices (None: one device; jax reads
    them when its backend starts, so a test process cannot change its own), compiling as the
    tests do (``FAST_COMPILE``). Fails with the command, its exit
    status and the tails of its stdout and stderr unless it exits 0 with stdout ending in
    ``ends_with`` (when given). Returns the ``subprocess.CompletedProcess``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": FAST_COMPILE}
    if devices is not None:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    command = [sys.executable, *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    ended = ends_with is None or done.stdout.strip().endswith(ends_with)
    assert done.returncode == 0 and ended, (
        f"{shlex.join(command)}: exit status {done.returncode}"
        f"{'' if ended else f', stdout does not end in {ends_with!r}'}"
        f"\n--- stdout tail ---\n{done.stdout[-1000:]}\n--- stderr tail ---\n{done.stderr[-3000:]}")
    return done


jax.config.update("jax_default_matmul_precision", "highest")
