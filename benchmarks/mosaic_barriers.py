"""Warpgroup barriers in each Mosaic GPU kernel, read on a CPU (no device needed).

    python benchmarks/mosaic_barriers.py [--core gdn|deltanet] [--print KERNEL]

Lowers ``delta_rule(impl="pallas")`` forward and backward (the default pipeline, as on an
H200: ``state_mosaic.hopper`` is made to answer True) and OSDN's phase 1 with
``Options(mosaic_loops=True)`` for CUDA at a small shape, catches the module each Mosaic
kernel hands to its serialisation (``mosaic.gpu.core._run_serde_pass``) and prints, per
kernel, the ``bar.sync`` instructions in all and by loop depth (``scf.for`` / ``scf.while``
regions: the ones paid every chunk or token). Pallas puts one before and one after every
shared-memory store unless a kernel passes ``unsafe_no_auto_barriers`` (NOTES, session 17).
``--print KERNEL``: that kernel's module text as well.
"""

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.mosaic.gpu import core  # noqa: E402

from conftest import _lowered_for_cuda  # noqa: E402
from pallas_kernels import state_mosaic  # noqa: E402
from pallas_kernels.delta_rule import delta_rule_pallas  # noqa: E402
from pallas_kernels.osgm_precond import Options, osgm_pallas  # noqa: E402

NAME = re.compile(r"func\.func @(\w+)_mosaic_gpu\(")


def barriers(text):
    """``bar.sync`` counts of a module's text by loop depth ({0: outside loops, 1: in one
    scf.for / scf.while region, 2: in a loop inside a loop, ...}): regions are tracked by the
    braces that end and start lines."""
    stack, counts = [], collections.Counter()
    for line in text.splitlines():
        body = line.strip()
        if "bar.sync" in body:
            counts[stack.count("loop")] += 1
        if body.startswith("}"):
            kind = stack.pop() if stack else "other"
            if body.endswith("{"):  # "} do {": the while's second region
                stack.append(kind)
            continue
        if body.endswith("{"):
            stack.append("loop" if re.search(r"scf\.(for|while)\b", body) else "other")
    return counts


def modules(fn, args):
    """{kernel name: module text} of the Mosaic kernels in ``fn`` lowered for CUDA."""
    found, original = {}, core._run_serde_pass

    def catch(module, **kw):
        text = str(module)
        match = NAME.search(text)
        found[match.group(1) if match else f"kernel{len(found)}"] = text
        return original(module, **kw)

    core._run_serde_pass = catch
    try:
        _lowered_for_cuda(fn, args)
    finally:
        core._run_serde_pass = original
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--core", choices=["deltanet", "gdn"], default="gdn")
    ap.add_argument("--print", dest="show")
    a = ap.parse_args()
    B, T, H, K = 1, 256, 1, 128
    s = jax.ShapeDtypeStruct
    tok, row = s((B, T, H, K), jnp.bfloat16), s((B, T, H), jnp.bfloat16)
    gated = a.core == "gdn"

    def delta(q, k, kw, v, beta, g):
        def loss(*xs):
            o, _ = delta_rule_pallas(*xs, g if gated else None, K ** -0.5, None, None, 64,
                                     interpret=False)
            return jnp.sum(o.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, kw, v, beta)

    def phase1(k, beta, r):
        def loss(k, beta, r):
            kw, _ = osgm_pallas(k, beta, r, 0.003, 0.5, 2.0, True, 1e-6, None, None, 64,
                                Options(mosaic_loops=True, picard_iters=0), interpret=False)
            return jnp.sum(kw.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(k, beta, r)

    hopper = state_mosaic.hopper
    state_mosaic.hopper = lambda: True
    try:
        found = modules(delta, (tok, tok, tok, tok, row, s((B, T, H), jnp.float32)))
        found |= modules(phase1, (tok, row, row))
    finally:
        state_mosaic.hopper = hopper
    print(f"{'kernel':<28} {'bar.sync':>8}   by loop depth")
    for name, text in found.items():
        counts = barriers(text)
        print(f"{name:<28} {sum(counts.values()):>8}   {dict(sorted(counts.items()))}")
    if a.show:
        print(found[a.show])


if __name__ == "__main__":
    main()
