"""Device benchmark of the twelve composed ops (issue 4): backbone (DeltaNet, GDN, KDA core) x
preconditioner (none, OSGM, OSGM with APF retention, ATK), phase 1 then the delta core with k̃:

    none:      k̃ = k
    osgm(_apf): k̃ = osgm_precondition(k, β, retention = r or None)      (OSDN, OSDN-APF, OSGDN, OSKDA)
    atk:       k̃ = atk_precondition(k, g^P, β^P, c)                      (PDN, PGDN, PKDA)
    o = delta_rule(q, k, v, β, write_key=k̃, log_decay=g)

    PYTHONPATH=. python3 benchmarks/bench_ops.py [--shape B T H D] [--models osdn,pgdn,...]
        [--sections checks,time] [--impl auto] [--budget-s 300] [--timing sync|pipelined]
        [--profile DIR]  # the device time by kernel of every timed row, from a trace
        [--delta-variant auto/64/4/2/vmosaic]  # the delta core's options (bench_delta.variant)

``fp32`` prints, per model, the errors of ``--impl`` and of the chunked form (both bf16, on the
checks' inputs) against the chunked form in fp32: whether a failed check is the kernel's error or
the bf16 reference's own; with ``--save-fp32 DIR`` each model's problem and fp32 answer go to
``DIR/<model>.npz`` (``fp32_record``), where ``bench_fla.py --against DIR`` measures FLA's bf16
errors on them (the plain backbones: deltanet, gdn, kda).
``phase`` times the ATK phase alone (``atk_precondition`` on its Pallas kernels), and checks it
against the chunked form at ``--check-shape``, for each ``--atk-pieces`` entry: a count of
sequence pieces for the Triton kernels
(``atk_precond.Options.sequence_pieces``; "auto": ``auto_pieces``) or "mosaic" (the Mosaic
kernels of ``atk_mosaic``, ``Options(mosaic=True)``; "mosaic2" on two warpgroups).
Timings run first, then checks (one time budget for both). Checks: ``--impl`` against
``impl="chunked"`` on the same fresh inputs at ``--check-shape`` (bf16; bars of bench_delta:
outputs 6e-3, gradients of every input 8e-3). Timings: forward and
forward+backward (gradients of every input) at ``--shape``, bf16, with the ratio to the same
backbone without a preconditioner (issue 4's targets: OSDN and OSDN-APF <= 1.10x DeltaNet's core,
PGDN / PKDA <= 1.2x jax-linear-attention's GDN / KDA). Records go to benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

import precond_linattn as pla
from benchmarks import bench_delta, fp32_record
from benchmarks.bench_delta import (DECAYS, Guard, check, cotangents, elapsed, make_inputs,
                                    time_op, values_and_grads)
from pallas_kernels import delta_rule

PRECONDITIONERS = ("none", "osgm", "osgm_apf", "atk")
NAMES = {("deltanet", "none"): "deltanet", ("deltanet", "osgm"): "osdn",
         ("deltanet", "osgm_apf"): "osdn-apf", ("deltanet", "atk"): "pdn",
         ("gdn", "none"): "gdn", ("gdn", "osgm"): "osgdn", ("gdn", "osgm_apf"): "osgdn-apf",
         ("gdn", "atk"): "pgdn", ("kda", "none"): "kda", ("kda", "osgm"): "oskda",
         ("kda", "osgm_apf"): "oskda-apf", ("kda", "atk"): "pkda"}


def inputs(key, B, T, H, D, backbone, dtype):
    """bench_delta's layer-like inputs plus the preconditioners' gates: APF retention σ(x + 6),
    ATK log decay log σ(x + 4) per head, ATK gain σ(x), centre −0.2 (the layers' init)."""
    x, _ = make_inputs(key, B, T, H, D, DECAYS[backbone], dtype)
    ks = jax.random.split(jax.random.fold_in(key, 1), 3)
    x["r"] = jax.nn.sigmoid(jax.random.normal(ks[0], (B, T, H)) + 6.0).astype(dtype)
    x["gp"] = jax.nn.log_sigmoid(jax.random.normal(ks[1], (B, T, H)) + 4.0)
    x["bp"] = jax.nn.sigmoid(jax.random.normal(ks[2], (B, T, H))).astype(dtype)
    x["c"] = jnp.full((H,), -0.2, jnp.float32)
    del x["kw"]
    return x


def composed(precond, impl):
    """(inputs) -> (o, final state) of the composed op with ``impl`` for every phase."""
    def f(x):
        k = x["k"]
        if precond == "none":
            kw = k
        elif precond.startswith("osgm"):
            kw = pla.osgm_precondition(k, x["beta"], retention=x["r"] if precond == "osgm_apf"
                                       else None, impl=impl)[0]
        else:
            kw = pla.atk_precondition(k, x["gp"], x["bp"], x["c"], impl=impl)[0]
        return pla.delta_rule(x["q"], k, x["v"], x["beta"], write_key=kw, log_decay=x.get("g"),
                              output_final_state=True, impl=impl)
    return f


def against_fp32(name, precond, impl, x, key, save_dir=None):
    """Relative RMS error against the chunked form in fp32 (the bf16 inputs cast up) of ``impl``
    and of the chunked form, both in bf16, for the outputs and every gradient: whether ``impl``
    is as exact as the bf16 reference it is checked against (``values_and_grads``: the same
    cotangents for all three). With ``save_dir``, the problem, its fp32 answer and these errors
    go to ``save_dir/name.npz`` (``fp32_record``: FLA's errors on it, ``bench_fla --against``)."""
    ref = values_and_grads(composed(precond, "chunked"),
                           jax.tree.map(lambda a: a.astype(jnp.float32), x), key)
    used = {n: g for n, g in ref[2].items() if bool(jnp.any(g != 0))}  # the model's inputs
    r = dict(check=f"{name} vs fp32 chunked")
    for label, impl_ in ((f"{impl} bf16", impl), ("chunked bf16", "chunked")):
        got = values_and_grads(composed(precond, impl_), x, key)
        r[label] = fp32_record.errors(got[0], got[1], got[2], ref[0], ref[1], used)
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        fp32_record.save(os.path.join(save_dir, f"{name}.npz"), name,
                         {n: x[n] for n in used}, cotangents(key, ref[0], ref[1]),
                         (ref[0], ref[1], used), {k: v for k, v in r.items() if k != "check"})
    r["t_s"] = round(elapsed())
    print(json.dumps(r), flush=True)
    return r


def atk_phase(pieces):
    """(inputs) -> (k̃, final A) of the ATK phase on the Triton kernels cut into ``pieces``, or
    with "mosaic" on the Mosaic ones ("mosaic2": on two warpgroups)."""
    from pallas_kernels.atk_precond import Options, atk_pallas
    mosaic = {"mosaic": Options(mosaic=True),
              "mosaic2": Options(mosaic=True, mosaic_warpgroups=2)}
    options = mosaic.get(pieces) or Options(
        sequence_pieces=None if pieces == "auto" else int(pieces), mosaic=False)

    def f(x):
        return atk_pallas(x["k"], x["gp"], x["bp"], x["c"], 1.5, 1e-6, None, None, 64, options)
    return f


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=(8, 2048, 8, 128))
    p.add_argument("--check-shape", type=int, nargs=4, default=(2, 1000, 4, 128))
    p.add_argument("--models", default=",".join(NAMES.values()))
    p.add_argument("--sections", default="checks,time", help="checks, time, phase, fp32")
    p.add_argument("--atk-pieces", default="auto,mosaic",
                   help="the phase rows' sequence pieces (Triton), or mosaic / mosaic2")
    p.add_argument("--impl", default="auto")
    p.add_argument("--save-fp32", metavar="DIR", help="the fp32 section's problems and answers "
                   "as DIR/<model>.npz, for bench_fla.py --against DIR")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--timing", choices=("sync", "pipelined"), default="sync",
                   help="bench_delta.timeit's: each call waited for, or calls queued back to back")
    p.add_argument("--profile", metavar="DIR", help="trace the timed calls there and print the "
                   "device time by kernel of each row")
    p.add_argument("--delta-variant", default=None, help="the delta core's options as a "
                   "bench_delta variant string (e.g. auto/64/4/2/vmosaic), for every op")
    a = p.parse_args()
    with delta_rule.default_options(a.delta_variant and bench_delta.variant(a.delta_variant)):
        run(p, a)


def run(p, a):
    """The sections of ``a`` (``main``'s parsed arguments; ``p`` its parser, for errors)."""
    bench_delta.PIPELINED[0], bench_delta.PROFILE[0] = a.timing == "pipelined", a.profile
    wanted = a.models.split(",")
    unknown = sorted(set(wanted) - set(NAMES.values()))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {list(NAMES.values())}")
    print(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                          shape=a.shape, date=time.strftime("%Y-%m-%d %H:%M"))), flush=True)
    key, guarded = jax.random.key(int(time.time())), Guard(a.budget_s)
    models = [(b, pc, n) for (b, pc), n in NAMES.items() if n in wanted]
    checks, times = [], {}
    for backbone, precond, name in models if "time" in a.sections else ():
        x = inputs(jax.random.fold_in(key, 7), *a.shape, backbone, jnp.bfloat16)
        times[name] = guarded(f"time {name}", lambda: time_op(name, composed(precond, a.impl), x,
                                                              a.reps))
    if "phase" in a.sections:
        x = inputs(jax.random.fold_in(key, 8), *a.shape, "deltanet", jnp.bfloat16)
        x = {n: x[n] for n in ("k", "gp", "bp", "c")}
        for pieces in a.atk_pieces.split(","):
            label = f"atk phase pieces={pieces}"
            times[label] = guarded(f"time {label}", lambda pieces=pieces, label=label: time_op(
                label, atk_phase(pieces), x, a.reps))
        xc = inputs(jax.random.fold_in(key, 9), *a.check_shape, "deltanet", jnp.bfloat16)
        xc = {n: xc[n] for n in ("k", "gp", "bp", "c")}
        chunked = lambda x: pla.atk_precondition(x["k"], x["gp"], x["bp"], x["c"],  # noqa: E731
                                                 output_final_state=True, impl="chunked")
        for pieces in a.atk_pieces.split(","):
            checks.append(guarded(f"check atk phase {pieces}", lambda pieces=pieces: check(
                f"atk phase {pieces} vs chunked", atk_phase(pieces), chunked, xc,
                jax.random.fold_in(key, 99), jnp.bfloat16)))
    for i, (backbone, precond, name) in enumerate(
            models if "checks" in a.sections or "fp32" in a.sections else ()):
        x = inputs(jax.random.fold_in(key, i), *a.check_shape, backbone, jnp.bfloat16)
        ct_key = jax.random.fold_in(key, 100 + i)
        if "checks" in a.sections:
            checks.append(guarded(f"check {name}", lambda precond=precond, name=name, x=x,
                                  ct_key=ct_key: check(
                f"{name} {a.impl} vs chunked", composed(precond, a.impl),
                composed(precond, "chunked"), x, ct_key, jnp.bfloat16)))
        if "fp32" in a.sections:
            guarded(f"fp32 {name}", lambda precond=precond, name=name, x=x, ct_key=ct_key:
                    against_fp32(name, precond, a.impl, x, ct_key, a.save_fp32))

    print(f"\n{'check':32s} {'ok':>5s} {'err_o':>9s} {'err_final':>9s} {'err_grad':>9s}")
    for r in filter(None, checks):
        print(f"{r['check']:32s} {str(r['ok']):>5s} {r['err_o']:9.2e} {r['err_final']:9.2e} "
              f"{r['err_grad_max']:9.2e}")
    print(f"\n{'op (' + a.impl + '), bf16 ' + 'x'.join(map(str, a.shape)):32s} {'fwd ms':>8s} "
          f"{'fwd+bwd ms':>10s} {'MiB':>6s} {'fwd/core':>8s} {'f+b/core':>8s}")
    for label, r in times.items():
        if label.startswith("atk phase") and r is not None:
            print(f"{label:32s} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:10.3f} "
                  f"{str(r['fwdbwd_mib']):>6s}")
    for (backbone, precond), name in NAMES.items():
        r, base = times.get(name), times.get(NAMES[backbone, "none"])
        if r is None:
            continue
        ratio = (f"{r['fwd_ms'] / base['fwd_ms']:8.2f} {r['fwdbwd_ms'] / base['fwdbwd_ms']:8.2f}"
                 if base else "")
        print(f"{name:32s} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:10.3f} {str(r['fwdbwd_mib']):>6s} "
              f"{ratio}")
    print(f"elapsed {elapsed():.0f} s")


if __name__ == "__main__":
    main()
