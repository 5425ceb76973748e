"""Registers, spills and code size of the WY kernels as the H200 would run them, read on the
CPU: a kernel's spills decide its speed as much as its arithmetic (NOTES, v8.3 and v8.8), and
this read takes minutes without a device.

Two steps, two Python environments:

1. ``lower`` (this project's venv, jax 0.11.2): lower each kernel for CUDA under an abstract
   H100 mesh and write its Triton IR (``OUT/<kernel>.ttir``) and launch (``OUT/meta.json``).
2. ``compile`` (a separate venv with pip's ``triton==3.9.0``, which parses jax 0.11.2's IR):
   compile each IR for sm_90a and print, per thread: registers, spill stores / loads (STL /
   LDL), the stack frame and the SASS instruction count (``cuobjdump``; ``ptxas-blackwell -v``
   for registers and stack: the wheel's own ``ptxas``, CUDA 12.9, refuses triton 3.9's PTX).

    python benchmarks/sass_read.py lower /tmp/sass [--kernels wy_fwd,wy_vector_bwd]
    PYENV_VERSION=3.12.1 python3.12 -m venv /tmp/t39 && /tmp/t39/bin/pip install triton==3.9.0
    /tmp/t39/bin/python benchmarks/sass_read.py compile /tmp/sass

The kernels run at the op's defaults for bf16 inputs on the device: B = 8, T = 2048, H = 8,
K = V = 128, C = 64, key and value tiles of 64, 2 stages; the WY forward at tf32 with bf16
outputs (4 warps with a scalar decay, 8 per channel), the pullback at bf16 with 8 warps.
"""

import argparse
import collections
import json
import os
import re
import subprocess

KERNELS = ("wy_fwd", "wy_bwd", "wy_vector_fwd", "wy_vector_bwd")
B, T, H, K, C = 8, 2048, 8, 128, 64


def kernel_calls():
    """{name: (function of ShapeDtypeStructs, their list, num_warps)} for ``KERNELS``."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.triton_common import Dots
    from pallas_kernels.wy_triton import wy_bwd, wy_fwd
    from pallas_kernels.wy_vector_triton import wy_vector_bwd, wy_vector_fwd

    sd = jax.ShapeDtypeStruct
    calls = {}
    for vector, (fwd, bwd) in ((False, (wy_fwd, wy_bwd)), (True, (wy_vector_fwd, wy_vector_bwd))):
        ins = [sd((B, T, H, K), jnp.bfloat16)] * 4 + [
            sd((B, T, H), jnp.bfloat16), sd((B, T, H) + (K,) * vector, jnp.float32)]
        tiles = dict(chunk=C, block_v=64, block_k=64, num_stages=2,
                     **({"factored_blocks": True} if vector else {}))
        fo = dict(tiles, dots=Dots("tf32"), num_warps=8 if vector else 4, out_dtype=jnp.bfloat16)
        bo = dict(tiles, dots=Dots("bf16"), num_warps=8)
        *wy, T_inv = jax.eval_shape(lambda *xs, f=fwd, o=fo: f(*xs, **o), *ins)
        cts = [sd(w.shape, jnp.float32) for w in wy]
        name = "wy_vector" if vector else "wy"
        calls[f"{name}_fwd"] = (lambda *xs, f=fwd, o=fo: f(*xs, **o), ins, fo["num_warps"])
        if vector:
            calls[f"{name}_bwd"] = (lambda *xs, f=bwd, o=bo: f(*xs, **o),
                                    ins + [T_inv] + cts, 8)
        else:  # the scalar pullback also reads the forward's P
            calls[f"{name}_bwd"] = (lambda *xs, f=bwd, o=bo: f(*xs[:-1], P=xs[-1], **o),
                                    ins + [T_inv] + cts + [sd(wy[4].shape, wy[4].dtype)], 8)
    return calls


def lower(out, names):
    """Write ``OUT/<name>.ttir`` (the Triton module of each kernel, lowered for CUDA) and
    ``OUT/meta.json`` ({name: num_warps, num_stages})."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as registration
    from jax.sharding import AbstractDevice, AbstractMesh

    captured = []
    real = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        module = real(*args, **kwargs)
        captured.append(module.module.operation.get_asm())
        return module

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
    os.makedirs(out, exist_ok=True)
    meta, calls = {}, kernel_calls()
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        for name in names:
            fn, args, warps = calls[name]
            captured.clear()
            with jax.sharding.use_abstract_mesh(mesh):
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            if len(captured) != 1:
                raise RuntimeError(f"{name}: {len(captured)} Triton modules, expected 1")
            with open(os.path.join(out, f"{name}.ttir"), "w") as f:
                f.write(captured[0])
            meta[name] = dict(num_warps=warps, num_stages=2)
            print(f"{name}: {len(captured[0])} characters of Triton IR", flush=True)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = real
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f)


def sass_counts(sass):
    """{opcode: count} of a ``cuobjdump -sass`` listing."""
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def compile_and_count(out):
    """Compile every ``OUT/*.ttir`` (``meta.json``'s launch) with pip's triton for sm_90a and
    print its registers, STL / LDL, stack bytes and SASS instructions a thread."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said aloud
    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    print(f"{'kernel':16s} {'regs':>5s} {'STL':>6s} {'LDL':>6s} {'stack B':>8s} {'SASS':>7s}")
    for name, launch in meta.items():
        kernel = triton.compile(os.path.join(out, f"{name}.ttir"), target=GPUTarget("cuda", 90, 32),
                                options=launch)
        ptx, cubin = (os.path.join(out, f"{name}.{ext}") for ext in ("ptx", "cubin"))
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        verbose = subprocess.run([os.path.join(tools, "ptxas-blackwell"), "-v",
                                  "--regAllocOptLevel=2", "--gpu-name=sm_90a", ptx, "-o",
                                  os.path.join(out, f"{name}.check.cubin")],
                                 capture_output=True, text=True)
        info = verbose.stdout + verbose.stderr
        ops = sass_counts(subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                                         capture_output=True, text=True, check=True).stdout)
        regs = re.search(r"Used (\d+) registers", info)
        stack = re.search(r"(\d+) bytes stack frame", info)
        print(f"{name:16s} {regs.group(1) if regs else '?':>5s} {ops['STL']:6d} {ops['LDL']:6d} "
              f"{stack.group(1) if stack else '?':>8s} {sum(ops.values()):7d}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("lower", "compile"))
    p.add_argument("out", help="the folder of the Triton IR and the compiled kernels")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"for lower: some of {','.join(KERNELS)}")
    a = p.parse_args()
    if a.step == "lower":
        names = a.kernels.split(",")
        unknown = sorted(set(names) - set(KERNELS))
        if unknown:
            p.error(f"--kernels: unknown {unknown}; valid: {','.join(KERNELS)}")
        lower(a.out, names)
    else:
        compile_and_count(a.out)


if __name__ == "__main__":
    main()
