"""How many Picard sweeps ``osgm_mosaic``'s kernels run a tile, and what a sweep costs (issue 4).

    python benchmarks/probe_sweeps.py [--shape B T H K] [--eta 0.003] [--bound] [--cpu]
        [--vanilla] [--warpgroups 2]

On the inputs of ``bench_osgm`` (unit keys, β = σ(x), APF r = σ(x + 6), bf16) it swaps
``osgm_mosaic._settle`` for a counting one whose result row carries, for each tile, the
number of sweeps run and the last sweep that still moved the coupling (the forward's a row,
the backward's γ row: the backward's ∂k, which uses γ, is then wrong; the forward's results
are not), and prints their distribution; then it times the forward with the
sweeps fixed at 1, 2, 4 and 8 (no convergence test), whose differences are the cost of a
sweep. The sweeps stop bit for bit (the kernels' default), with ``--bound`` at ``_accepts``'
contraction bound too (``bound_stop``). ``--vanilla``: no retention (OSDN; the model,
``sweep_model.py``, counts 3.0 / 3.97 sweeps there against APF's 2.14 / 3.10).
``--warpgroups 2``: both kernels on two warpgroups (the ops' default; 1 by default here).
``--cpu``: interpret mode at a small shape (checks the script, times nothing real).
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.bench_osgm import make_inputs
from pallas_kernels import osgm_mosaic as om, rows_mosaic
from pallas_kernels.state_mosaic import ROWS
from precond_linattn.chunked.osgm_picard import coefficients

REAL_SETTLE = om._settle


def counting_settle(step, x0, carry0, accept, fixed=None):
    """``osgm_mosaic._settle`` (or exactly ``fixed`` sweeps) returning, in place of the
    coupling, n + 1000 m per row: n sweeps run, m the last whose coupling moved."""
    def body(c):
        x, carry, _, n, last = c
        x_new, carry = step(x)
        moved = jnp.max(jnp.abs(x_new - x)) > 0.0
        return x_new, carry, om._go_on(x_new, x, accept), n + 1, jnp.where(moved, n + 1, last)

    def cond(c):
        return (c[2] & (c[3] <= om.TILE)) if fixed is None else c[3] < fixed

    _, carry, _, n, last = lax.while_loop(
        cond, body, (x0, carry0, jnp.bool_(True), jnp.int32(0), jnp.int32(0)))
    code = (n + 1000 * last).astype(jnp.float32)
    return plgpu.layout_cast(jnp.broadcast_to(code, x0.shape), ROWS), carry


def timed(f, *args, reps):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e3


def describe(name, code):
    n, last = code % 1000, code // 1000
    print(f"{name}: sweeps a tile min {float(n.min()):.0f} mean {float(n.mean()):.2f} max "
          f"{float(n.max()):.0f}; last moving sweep mean {float(last.mean()):.2f} max "
          f"{float(last.max()):.0f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=(8, 2048, 8, 128))
    ap.add_argument("--eta", type=float, default=0.003)
    ap.add_argument("--bound", action="store_true", help="the kernels' bound_stop=True")
    ap.add_argument("--vanilla", action="store_true", help="no APF retention (OSDN)")
    ap.add_argument("--warpgroups", type=int, choices=(1, 2), default=1)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    B, T, H, K = (1, 128, 1, 128) if a.cpu else a.shape
    x, _ = make_inputs(jax.random.PRNGKey(0), B, T, H, K, jnp.bfloat16)
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    coefs = coefficients(f32(x["k"]), f32(x["beta"]), None if a.vanilla else f32(x["r"]),
                         a.eta, True, 1e-6)
    rows = om.coefficient_rows(coefs, T)
    init = jnp.ones((B, H, K), jnp.float32)
    kw = dict(bounds=(0.5, 2.0), interpret=a.cpu, bound_stop=a.bound, warpgroups=a.warpgroups)
    fwd = lambda: jax.jit(functools.partial(om.osgm_fwd, residuals=True, **kw))  # noqa: E731
    reps = 1 if a.cpu else 20  # (a new jit for each ``_settle``: the kernel is traced again)
    real = fwd()
    print(f"{B}x{T}x{H}x{K} bf16, eta {a.eta}, {'vanilla' if a.vanilla else 'APF'}"
          f", {a.warpgroups} warpgroup(s): forward "
          f"{timed(real, x['k'], rows, init, reps=reps):.3f} ms")
    _, _, fwd_rows, starts = real(x["k"], rows, init)
    u, av = rows_mosaic.token_rows(fwd_rows, T)
    brows = om.backward_rows(coefs, u, av, 1e-6, T)
    dkw = jax.random.normal(jax.random.PRNGKey(1), x["k"].shape, jnp.bfloat16)
    bwd = jax.jit(functools.partial(om.osgm_bwd, **kw))
    bargs = (x["k"], dkw, brows, starts, init, init * 0.1)
    print(f"backward {timed(bwd, *bargs, reps=reps):.3f} ms")
    om._settle = counting_settle
    try:
        describe("forward", fwd()(x["k"], rows, init)[2][:, :, 1, ::om.TILE])
        describe("backward", jax.jit(functools.partial(om.osgm_bwd, **kw))(*bargs)[1][:, :, 0, ::om.TILE])
        for n in (1, 2, 4, 8):
            om._settle = functools.partial(counting_settle, fixed=n)
            print(f"forward, {n} sweeps a tile: {timed(fwd(), x['k'], rows, init, reps=reps):.3f} ms")
    finally:
        om._settle = REAL_SETTLE


if __name__ == "__main__":
    main()
