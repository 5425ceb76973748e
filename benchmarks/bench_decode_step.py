"""Decode-step latency of a language model: ``--steps`` greedy tokens, y_{i+1} = argmax
model.step(y_i, cache), in one jitted ``lax.fori_loop`` (as ``generate``'s loop runs them, without
the prefill), median of 5 runs after 2 warm-ups; per preconditioner, with the layers' recurrent
step as the two ops (``--fused off``) or as ``pallas_kernels.decode_step``'s one kernel (``on``;
``auto``: the layer's default).
It isolates the decode part of ``bench_generate.py`` (which compiles a prefill too, ~150 s a
model at 340M), so the OS-* decode gap against the host backbone is measured in ~20 s a variant.

    python benchmarks/bench_decode_step.py [--preset deltanet-340m] [--preconditioners none osgm]
        [--fused off on] [--launch 32/4 64/2 128/1] [--steps 64] [--tiny]

``--launch BV/W ...``: the fused rows once per ``decode_step.Launch`` (V tile BV, W warps).
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.bench_generate import FUSED_DECODE, model_for
from pallas_kernels.decode_step import Launch, default_launch


def launch(text):
    """A ``Launch`` from "BV/W"."""
    try:
        block_v, num_warps = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--launch takes BV/W, e.g. 32/4, got {text!r}") from None
    return Launch(block_v, num_warps)


def decode_loop(model, steps):
    """(jitted call, its arguments): ``steps`` greedy steps y_{i+1} = argmax model.step(y_i,
    cache) from the empty cache at batch 1, in one ``lax.fori_loop``; returns the last token."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def decode(state, token):
        m = nnx.merge(graphdef, state)

        def body(_, carry):
            token, cache = carry
            logits, cache = m.step(token, cache)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, steps, body, (token, m.init_cache(1)))[0]

    return decode, (state, jnp.zeros((1,), jnp.int32))


def step_seconds(model, steps, runs=5, warmups=2):
    """Median seconds of one decode step of ``decode_loop``."""
    decode, args = decode_loop(model, steps)
    for _ in range(warmups):
        jax.block_until_ready(decode(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(decode(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deltanet-340m")
    p.add_argument("--preconditioners", nargs="+", default=["none", "osgm"])
    p.add_argument("--fused", nargs="+", choices=list(FUSED_DECODE), default=["off", "on"],
                   help="LayerConfig.fused_decode of each row (bench_generate's --fused-decode)")
    p.add_argument("--launch", nargs="+", type=launch, default=[Launch()],
                   help="the fused kernel's V tile / warps, one set of fused rows each")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {a.preset}, {a.steps} steps",
          flush=True)
    rows = []
    for fused in a.fused:
        for lc in a.launch if fused != "off" else [None]:
            tag = fused if lc is None else f"{fused} {lc.block_v}/{lc.num_warps}"
            for pre in a.preconditioners:
                t0 = time.perf_counter()
                with default_launch(lc):
                    us = 1e6 * step_seconds(model_for(a.preset, pre, fused, a.tiny), a.steps)
                rows.append(dict(preconditioner=pre, fused=tag, step_us=round(us, 1),
                                 wall_s=round(time.perf_counter() - t0)))
                print(json.dumps(rows[-1]), flush=True)
    host = {r["fused"]: r["step_us"] for r in rows if r["preconditioner"] == "none"}
    print(f"\n{'preconditioner':16s} {'fused':>9s} {'step us':>8s} {'vs none':>8s}")
    for r in rows:
        ratio = r["step_us"] / host[r["fused"]] if r["fused"] in host else float("nan")
        print(f"{r['preconditioner']:16s} {r['fused']:>9s} {r['step_us']:8.1f} {ratio:8.3f}")


if __name__ == "__main__":
    main()
