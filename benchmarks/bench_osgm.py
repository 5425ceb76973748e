"""Device benchmark of osgm_precondition(impl="pallas") (OSDN phase 1): checks, then timings.

    PYTHONPATH=. python3 benchmarks/bench_osgm.py [--shape B T H K] [--budget-s 100]
        [--sections checks|variant-checks,time,baselines,osdn] [--variants 4/1,2/1/4,2/1/16/8,2/1/8/p8]
        # kernel options prefetch/num_warps[/unroll[/bwd_unroll]][/scalar][/pN[/bkM]]: prefetch
        # in loop iterations (groups of ``unroll`` tokens), ``scalar``: Options.scalar_aux, pN:
        # the forward by at most N Picard sweeps over blocks of M coordinates

Checks (fresh random inputs; device memory filled with NaN before each run): pallas vs the
token-by-token reference, k̃, final d and the gradients of k, β, r and d_1 for a random
cotangent, relative RMS error with the bars of bench_delta (bf16 6e-3 outputs, 8e-3 gradients;
fp32 1e-4): the paper's setting (η = 0.003, APF retention σ(x + 6)) in fp32 and bf16, and a
clip-active one (η = 1, beta-free, skewed keys) in fp32, packed documents in fp32 and bf16, and
the first two for the Picard form (``chunked.osgm_picard``, with its iteration count). Timings
(bf16, median after warm-up): phase 1 alone with each variant's kernels (APF; ``--vanilla``:
without), forward and forward+backward (gradients of k, β, r); ``baselines``: the chunked form
and the Picard form in XLA (APF), the default kernels and the chunked form without APF (the
chunked rows take ~40 s); ``osdn``: the whole OSDN op (phase 1 + the Pallas delta core with k̃)
against the core alone with k̃ = k. Every variant but the first is also checked (all four cases)
after the timings; ``variant-checks`` (instead of ``checks``): those checks (bf16 included) of
every variant, not the defaults'.
Prints JSON lines and one table; records go to benchmarks/RESULTS.md.
"""

import argparse
import json

import jax
import jax.numpy as jnp

import precond_linattn as pla
from benchmarks import bench_delta
from benchmarks.bench_delta import BARS, Guard, elapsed, rel_rms, timeit, values_and_grads
from pallas_kernels.osgm_precond import Options, osgm_pallas
from precond_linattn.chunked.osgm_picard import osgm_picard, osgm_picard_steps


def make_inputs(key, B, T, H, K, dtype, skewed=False):
    """Unit keys (``skewed``: norm 4 on three coordinates), β = σ(x), APF r = σ(x + 6), d_1 ones."""
    ks = jax.random.split(key, 4)
    k = jax.random.normal(ks[0], (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    if skewed:
        k = k * jnp.where(jnp.arange(K) < 3, 4.0 * K ** 0.5, 1.0)
    return dict(k=k.astype(dtype), beta=jax.nn.sigmoid(jax.random.normal(ks[1], (B, T, H))).astype(dtype),
                r=jax.nn.sigmoid(jax.random.normal(ks[2], (B, T, H)) + 6.0).astype(dtype),
                d0=jnp.ones((B, H, K), jnp.float32)), ks[3]


def phase1(impl, eta=0.003, beta_aware=True, apf=True, options=None, cu_seqlens=None):
    """(inputs) -> (k̃, final d); ``cu_seqlens``: packed documents (one row, a d_1 each)."""
    def f(x):
        r = x["r"] if apf else None
        if options is not None:
            return osgm_pallas(x["k"], x["beta"], r, eta, 0.5, 2.0, beta_aware, 1e-6, x["d0"],
                               cu_seqlens, 64, options)
        if impl == "picard":  # the parallel-in-time algorithm in XLA (float32)
            kw, final = osgm_picard(*(None if a is None else a.astype(jnp.float32)
                                      for a in (x["k"], x["beta"], r)),
                                    eta, 0.5, 2.0, beta_aware, 1e-6, x["d0"], None)
            return kw.astype(x["k"].dtype), final
        return pla.osgm_precondition(x["k"], x["beta"], eta=eta, retention=r,
                                     beta_aware=beta_aware, initial_state=x["d0"],
                                     output_final_state=True, cu_seqlens=cu_seqlens, impl=impl)
    return f


def packed(x, key):
    """The rows of ``x`` as one packed row of documents whose boundaries fall inside tiles and
    rows (one of a single token), each with its own d_1 in [0.7, 1.8]: (inputs, cu_seqlens)."""
    B, T, H, K = x["k"].shape
    total = B * T
    cu = jnp.asarray(sorted({0, 5, 6, min(T + 37, total - 1), total // 2 + 11, total}),
                     jnp.int32)
    d0 = jax.random.uniform(key, (len(cu) - 1, H, K), jnp.float32, 0.7, 1.8)
    rows = {n: v.reshape(1, total, *v.shape[2:]) for n, v in x.items() if n != "d0"}
    return {**rows, "d0": d0}, cu


def variant(text):
    """``Options`` from "prefetch/num_warps[/unroll[/bwd_unroll]][/scalar][/pN[/bkM][/fixed]
    [/cpN|/cpauto]][/mosaic[/wgN][/stN][/bitstop|/bound]]" (e.g. "4/1",
    "2/1/4/scalar", "2/1/16/8": the forward 16 tokens an iteration, the backward 8;
    "2/1/8/p8/bk32": phase 1 by at most 8 Picard sweeps each way over blocks of 32 coordinates;
    "fixed": exactly N sweeps, no early exit; "cp8" / "cpauto": each sweep over 8 /
    ``auto_pieces`` sequence pieces, ``Options.picard_pieces``, auto when not named, "cp1":
    unsplit; "mosaic": both directions on the Mosaic GPU kernels of ``osgm_mosaic``,
    ``Options.mosaic_loops``; "wg1" / "wg2": their forward on one / two warpgroups,
    ``mosaic_warpgroups``, by default Options'; "st1": their calls on XLA GPU stream 1,
    ``Options.stream``; "bitstop" / "bound": their sweeps stopped bit for bit only / at the
    contraction bound, ``mosaic_bound_stop`` False / True, by default Options'). Without "pN" the
    token loops (not ``picard_iters=None``'s choice by shape: a variant names its kernels)."""
    parts = text.split("/")
    flags = [t for t in parts if not t.isdigit()]
    numbers = [t for t in parts if t.isdigit()]
    picard = [int(t[1:]) for t in flags if t[:1] == "p" and t[1:].isdigit()]
    block = [int(t[2:]) for t in flags if t[:2] == "bk" and t[2:].isdigit()]
    pieces = [None if t == "cpauto" else int(t[2:]) for t in flags
              if t == "cpauto" or (t[:2] == "cp" and t[2:].isdigit())]
    warpgroups = [int(t[2:]) for t in flags if t in ("wg1", "wg2")]
    stream = [int(t[2:]) for t in flags if t[:2] == "st" and t[2:].isdigit()]
    known = (len(picard) + len(block) + len(pieces) + flags.count("scalar")
             + flags.count("fixed") + flags.count("mosaic") + len(warpgroups) + len(stream)
             + sum(flags.count(f) for f in ("bitstop", "bound")))
    if (not 2 <= len(numbers) <= 4 or known != len(flags) or parts[:len(numbers)] != numbers
            or {"bitstop", "bound"} <= set(flags)):
        raise ValueError("--variants entries are prefetch/num_warps[/unroll[/bwd_unroll]]"
                         "[/scalar][/pN[/bkM][/fixed][/cpN|/cpauto]]"
                         "[/mosaic[/wgN][/stN][/bitstop|/bound]], "
                         f"got {text!r}")
    numbers = list(map(int, numbers))
    return Options(*numbers[:3], scalar_aux="scalar" in flags,
                   bwd_unroll=numbers[3] if len(numbers) == 4 else None,
                   picard_iters=picard[0] if picard else 0,
                   picard_early_exit=bool(picard) and "fixed" not in flags,
                   mosaic_loops="mosaic" in flags,
                   **({"mosaic_bound_stop": "bound" in flags}
                      if "bound" in flags or "bitstop" in flags else {}),
                   **({"mosaic_warpgroups": warpgroups[0]} if warpgroups else {}),
                   **({"stream": stream[0]} if stream else {}),
                   **({"picard_block_k": block[0]} if block else {}),
                   **({"picard_pieces": pieces[0]} if pieces else {}))


def check(name, f_kernel, f_ref, x, key, dtype):
    """Relative RMS errors of k̃, final d and the gradients of k, β, r, d_1."""
    kw, kf, kg = values_and_grads(f_kernel, x, key)
    rw, rf, rg = values_and_grads(f_ref, x, key)
    finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves((kw, kf, kg)))
    err_g = {n: rel_rms(kg[n], rg[n]) if jnp.any(rg[n] != 0) else  # dβ ≡ 0 when beta-free
             (0.0 if not jnp.any(kg[n] != 0) else float("inf")) for n in rg}
    bar_o, bar_g = BARS[jnp.dtype(dtype).name]
    err_o, err_f = rel_rms(kw, rw), rel_rms(kf, rf)
    r = dict(check=name, ok=finite and max(err_o, err_f) <= bar_o and max(err_g.values()) <= bar_g,
             finite=finite, err_o=err_o, err_final=err_f, err_grad_max=max(err_g.values()),
             worst_grad=max(err_g, key=err_g.get), t_s=round(elapsed()))
    print(json.dumps(r), flush=True)
    return r


def time_op(label, f, x, reps):
    """Forward and forward+backward (gradients of k, β, r) median milliseconds."""
    fwd = jax.jit(lambda x: f(x)[0])
    loss = lambda k, b, r: jnp.sum(f({**x, "k": k, "beta": b, "r": r})[0].astype(jnp.float32) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    r = dict(op=label, fwd_ms=timeit(fwd, x, reps=reps),
             fwdbwd_ms=timeit(grad, x["k"], x["beta"], x["r"], reps=reps), t_s=round(elapsed()))
    print(json.dumps(r), flush=True)
    return r


def osdn(phase1_impl, apf, options=None):
    """The OSDN op: phase 1 (``phase1_impl`` with kernel ``options``; None: k̃ = k, plain
    DeltaNet) + the Pallas core."""
    def f(x):
        kw = x["k"] if phase1_impl is None else phase1(phase1_impl, apf=apf,
                                                       options=options)(x)[0]
        return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=kw, impl="pallas")
    return f


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=(8, 2048, 8, 128))
    p.add_argument("--sections", default="checks,time,baselines,osdn")
    p.add_argument("--variants", default="2/1/8,2/1/8/scalar,4/1,2/1/4,1/1/8")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=100)
    p.add_argument("--timing", choices=("sync", "pipelined"), default="sync",
                   help="bench_delta.timeit's: each call waited for, or all queued at once")
    p.add_argument("--vanilla", action="store_true", help="the variants' phase 1 rows without "
                   "APF retention (OSDN's phase 1)")
    a = p.parse_args()
    kind, apf = ("vanilla", False) if a.vanilla else ("APF", True)
    sections = set(a.sections.split(","))
    bench_delta.PIPELINED[0] = a.timing == "pipelined"
    B, T, H, K = a.shape
    print(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                          shape=a.shape)), flush=True)
    key = jax.random.key(0)
    results, timings, guarded = [], [], Guard(a.budget_s)

    names = a.variants.split(",")
    variants = [variant(v) for v in names]
    cases = [("paper APF fp32", jnp.float32, {}), ("paper APF bf16", jnp.bfloat16, {}),
             ("clip eta=1 beta-free fp32", jnp.float32, dict(eta=1.0, beta_aware=False)),
             ("packed APF fp32", jnp.float32, dict(packed=True)),
             ("packed APF bf16", jnp.bfloat16, dict(packed=True))]

    def checks(which, options=None, label="", impl="pallas"):
        """The checks ``cases[n]`` for n in ``which`` of ``impl`` (``options``' kernels; None:
        default); the Picard form also prints its iteration count."""
        for n in which:
            name, dtype, hyper = cases[n]

            def one(n=n, name=name, dtype=dtype, hyper=hyper):
                x, kc = make_inputs(jax.random.fold_in(key, n), B, T, H, K, dtype,
                                    skewed="eta" in hyper)
                hyper = dict(hyper)
                if hyper.pop("packed", False):
                    x, hyper["cu_seqlens"] = packed(x, kc)
                if impl == "picard":
                    its = osgm_picard_steps(x["k"], x["beta"], x["r"], hyper.get("eta", 0.003),
                                            0.5, 2.0, hyper.get("beta_aware", True), 1e-6,
                                            x["d0"], None)
                    print(json.dumps(dict(picard_iterations=int(its), case=name)), flush=True)
                return check(name + label, phase1(impl, options=options, **hyper),
                             phase1("reference", **hyper), x, kc, dtype)
            results.append(guarded(f"check {name}{label}", one))

    if "checks" in sections:
        checks(range(len(cases)))
        checks((0, 2), label=" picard", impl="picard")
    x, _ = make_inputs(jax.random.fold_in(key, 9), B, T, H, K, jnp.bfloat16)
    jobs = []
    if "time" in sections:  # the first variant first, the others after osdn
        jobs.append((f"phase 1 pallas[{names[0]}] {kind}",
                     phase1("pallas", options=variants[0], apf=apf)))
    if "baselines" in sections:
        jobs += [("phase 1 chunked APF", phase1("chunked")),
                 ("phase 1 picard (XLA) APF", phase1("picard")),
                 ("phase 1 pallas vanilla", phase1("pallas", apf=False)),
                 ("phase 1 chunked vanilla", phase1("chunked", apf=False))]
    if "osdn" in sections:
        qv = jax.random.split(jax.random.fold_in(key, 10))
        q = jax.random.normal(qv[0], x["k"].shape)
        x = {**x, "q": (q / jnp.linalg.norm(q, axis=-1, keepdims=True)).astype(jnp.bfloat16),
             "v": jax.random.normal(qv[1], x["k"].shape, jnp.bfloat16)}
        jobs += [("DeltaNet core (k̃ = k)", osdn(None, False)),
                 (f"OSDN (pallas[{names[0]}] phase 1 + core)", osdn("pallas", False, variants[0])),
                 (f"OSDN-APF (pallas[{names[0]}] phase 1 + core)",
                  osdn("pallas", True, variants[0]))]
    if "time" in sections:
        jobs += [(f"phase 1 pallas[{v}] {kind}", phase1("pallas", options=o, apf=apf))
                 for v, o in zip(names[1:], variants[1:])]
    for label, f in jobs:
        timings.append(guarded(f"time {label}", lambda label=label, f=f: time_op(label, f, x, a.reps)))
    checked = 0 if "variant-checks" in sections else 1 if "checks" in sections else len(names)
    for v, o in zip(names[checked:], variants[checked:]):
        checks(range(len(cases)), o, f" [{v}]")

    print(f"\n{'check':42s} {'ok':>5s} {'err_kw':>9s} {'err_final':>9s} {'err_grad':>9s}")
    for r in filter(None, results):
        print(f"{r['check']:42s} {str(r['ok']):>5s} {r['err_o']:9.2e} {r['err_final']:9.2e} "
              f"{r['err_grad_max']:9.2e}")
    print(f"\n{'op, bf16 ' + 'x'.join(map(str, a.shape)):40s} {'fwd ms':>8s} {'fwd+bwd ms':>10s}")
    for r in filter(None, timings):
        print(f"{r['op']:40s} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:10.3f}")
    print(f"elapsed {elapsed():.0f} s")


if __name__ == "__main__":
    main()
