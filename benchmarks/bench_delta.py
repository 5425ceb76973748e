"""Device benchmark of delta_rule(impl="pallas"): exactness checks, then timings, in one run.

    PYTHONPATH=. python3 benchmarks/bench_delta.py [--shape B T H D] [--budget-s 420]
        [--sections checks,packed,time,rows,jla,chunked,breakdown] [--check-dtypes bf16,fp32]
        [--variants auto/64/4]
        # a variant: precision/block_v/num_warps[/num_stages][/fused][/recompute][/vxla]
        #            [/pP][/kN][/bwN][/sN][/hbf16|/h32][/wbf16][/qP][/oserial|/okernel][/dserial]
        #            [/mosaic|/triton]
        #            (see ``variant``)

Checks (fresh random inputs per check; the device allocator is filled with NaN before each run so
an unwritten output element shows): pallas vs the chunked pure-JAX form, outputs, final states
and the gradients of every input, relative RMS error ‖a − b‖ / ‖b‖; bars bf16 6e-3 (outputs and
final state) and 8e-3 (gradients), fp32 1e-4. Timings: median wall time of ``--reps`` calls after
warm-up (``jax.block_until_ready``; ``--timing pipelined``: the mean of ``--reps`` calls queued
at once, ``timeit``), forward and forward+backward (gradients of every input), for
the DeltaNet, GDN and KDA cores with a separate write key (``--cores``: some of them);
jax-linear-attention's symmetric-key Mosaic GPU kernels at the same shape when the ``jla``
package imports (carry its wheel, see benchmarks/NOTES.md); ``rows``: the first variant's op as
the train step runs packed rows (``jax.vmap`` over rows, each a [1, T] sequence with
``cu_seqlens`` [0, T]: the same arithmetic as the dense batch). ``breakdown`` times the pieces of
the split pipeline per core. Prints JSON lines as it goes and one table at the end; records go to
benchmarks/RESULTS.md.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import precond_linattn as pla
from benchmarks.fp32_record import rel_rms
from benchmarks.kernel_times import kernel_table, trace_events
from pallas_kernels.delta_rule import Options, delta_rule_pallas
from precond_linattn.layers.init import a_log_init, dt_bias_init

DECAYS = {"deltanet": None, "gdn": 3, "kda": 4}
BARS = {"bfloat16": (6e-3, 8e-3), "float32": (1e-4, 1e-4)}
START = time.perf_counter()


def elapsed():
    return time.perf_counter() - START


def gates_arg(text):
    """``--gates``: "mild", "layer" or "const:R" with R > 0 (a float)."""
    try:
        ok = text in ("mild", "layer") or (text.startswith("const:") and float(text[6:]) > 0)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"--gates takes mild, layer or const:R (R > 0), "
                                         f"got {text!r}")
    return text


def make_inputs(key, B, T, H, D, decay, dtype, n_docs=None, gates="mild", similar=0.0):
    """Layer-like inputs: unit q, k (``similar`` s > 0: k = unit(z + s c), c one standard normal
    direction a (row, head), so keys have mean cosine s² / (1 + s²) as in trained models'
    chunks); k̃ = d ⊙ k, d in [0.5, 2]; β = σ(x); g = log σ(x + 4)
    (``gates="mild"``, ~−0.02 a token) or as the layers at init (``"layer"``: −exp(A_log)
    softplus(x + dt_bias) with A_log, dt_bias from ``layers.init``, x ~ N(0, 1): down to ~−10 a
    token, so some KDA chunks take the WY kernels' unfactored paths), or ``"const:R"``: g = −R
    everywhere (every KDA key tile takes one path: at C = 64 the whole chunk for R <= 1.25,
    blocks of s rows with s R / 2 <= 40 below that)."""
    ks = jax.random.split(key, 9)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    shared = similar * jax.random.normal(jax.random.fold_in(ks[1], 1), (B, 1, H, D))
    k = unit(jax.random.normal(ks[1], (B, T, H, D)) + shared)
    x = dict(q=unit(jax.random.normal(ks[0], (B, T, H, D))), k=k,
             kw=k * jax.random.uniform(ks[2], k.shape, minval=0.5, maxval=2.0),
             v=jax.random.normal(ks[3], (B, T, H, D)),
             beta=jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))))
    if decay is not None:
        shape = (B, T, H) if decay == 3 else (B, T, H, D)
        if gates == "mild":
            x["g"] = jax.nn.log_sigmoid(jax.random.normal(ks[5], shape) + 4.0)
        elif gates.startswith("const:"):
            x["g"] = jnp.full(shape, -float(gates[6:]), jnp.float32)
        else:
            ka, kd = jax.random.split(ks[8])
            A_log = a_log_init(0.0 if decay == 3 else 1.0)(ka, (H,) + (1,) * (decay - 3))
            dt_bias = dt_bias_init(kd, shape[2:])
            x["g"] = -jnp.exp(A_log) * jax.nn.softplus(jax.random.normal(ks[5], shape) + dt_bias)
    x = {n: a if n == "g" else a.astype(dtype) for n, a in x.items()}  # gates stay float32
    if n_docs is not None:
        x["s0"] = jax.random.normal(ks[6], (n_docs, H, D, D), jnp.float32)
    return x, ks[7]


def op(impl, options=None, cu_seqlens=None):  # noqa: D103
    """(inputs dict) -> (o, final) through the public op or the kernel with explicit options."""

    def f(x):
        args = (x["q"], x["k"], x["kw"], x["v"], x["beta"], x.get("g"))
        if impl == "pallas" and options is not None:
            return delta_rule_pallas(*args, x["q"].shape[-1] ** -0.5, x.get("s0"), cu_seqlens, 64,
                                     options)
        return pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], write_key=x["kw"],
                              log_decay=x.get("g"), initial_state=x.get("s0"),
                              output_final_state=True, cu_seqlens=cu_seqlens, impl=impl)
    return f


def rows_op(f):
    """``f`` (an ``op(..., cu_seqlens=[0, T])``) vmapped over the batch rows as [1, T] sequences,
    as ``train.step`` runs packed rows: (o [B, T, H, V], finals [B, 1, H, K, V])."""
    def one(row):
        o, final = f({n: a[None] for n, a in row.items()})
        return o[0], final
    return lambda x: jax.vmap(one)(x)


POISON_GIB = [4.0]


def poison():
    """Fill and free a few GiB of device memory with NaN so that fresh buffers start as NaN."""
    n = int(POISON_GIB[0] * 2**28)
    jax.block_until_ready(jnp.full((n,), jnp.nan, jnp.float32)).delete()


class Guard:
    """``guard(what, fn)``: run ``fn()`` unless the time budget is spent (the first item always
    runs); a failure is printed as JSON and gives None, so one case cannot end the run."""

    def __init__(self, budget_s):
        self.budget_s, self.started = budget_s, False

    def __call__(self, what, fn):
        if self.started and elapsed() > self.budget_s:
            print(json.dumps(dict(skipped=what, elapsed_s=round(elapsed()))), flush=True)
            return None
        self.started = True
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            print(json.dumps(dict(failed=what, error=f"{type(e).__name__}: {str(e)[:800]}")),
                  flush=True)
            return None


def cotangents(key, o, final):
    """Random cotangents of (o, final) drawn from ``key``: o's drawn in fp32 and rounded to bf16
    (the same values whatever o's dtype), the final state's in fp32."""
    ko, kf = jax.random.split(key)
    return (jax.random.normal(ko, o.shape).astype(jnp.bfloat16).astype(o.dtype),
            jax.random.normal(kf, final.shape))


def values_and_grads(f, x, key):
    """(out, final, gradients of x) of ``f(x) -> (out, final)`` for the ``cotangents`` drawn
    from ``key``; compiled first, then run on a device filled with NaN (``poison``). The
    cotangents are drawn outside the compiled program and passed in: drawn inside, XLA's GPU
    compiler may drop their f32 -> bf16 -> f32 rounding in one program and keep it in another
    (``xla_allow_excess_precision``), which moved every gradient of one side by ~1.7e-3
    (RESULTS run 208)."""
    cts = cotangents(key, *jax.eval_shape(f, x))

    def g(x, cts):
        (o, final), pullback = jax.vjp(f, x)
        return o, final, pullback(cts)[0]
    compiled = jax.jit(g).lower(x, cts).compile()
    poison()
    return jax.block_until_ready(compiled(x, cts))


def check(name, f_kernel, f_ref, x, key, dtype):
    """Relative RMS errors of outputs, final state and every gradient, kernel vs reference."""
    ko, kf, kg = values_and_grads(f_kernel, x, key)
    ro, rf, rg = values_and_grads(f_ref, x, key)
    finite = all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves((ko, kf, kg)))
    err_o, err_f = rel_rms(ko, ro), rel_rms(kf, rf)
    err_g = {n: rel_rms(kg[n], rg[n]) for n in rg}
    bar_o, bar_g = BARS[jnp.dtype(dtype).name]
    ok = finite and max(err_o, err_f) <= bar_o and max(err_g.values()) <= bar_g
    r = dict(check=name, ok=ok, finite=finite, err_o=err_o, err_final=err_f,
             err_grad_max=max(err_g.values()), worst_grad=max(err_g, key=err_g.get),
             t_s=round(elapsed()))
    print(json.dumps(r), flush=True)
    return r


PIPELINED = [False]  # ``--timing pipelined``
PROFILE = [None]  # ``--profile DIR``: time_op's calls traced there, their kernels printed


def timeit(f, *a, reps):
    """Milliseconds a call of a compiled function takes after two warm-up calls: the median of
    ``reps`` synchronous calls (each waited for: the host's per-call cost included, ~0.2-0.4 ms
    on the H200 against ncu's kernel sums), or with ``PIPELINED`` the mean of ``reps`` calls
    queued back to back and waited for once (the host's cost hidden behind the device's, as in
    a training loop)."""
    jax.block_until_ready(f(*a))
    jax.block_until_ready(f(*a))
    if PIPELINED[0]:
        t0 = time.perf_counter()
        jax.block_until_ready([f(*a) for _ in range(reps)])
        return round((time.perf_counter() - t0) / reps * 1e3, 3)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e3, 3)


def time_op(label, f, x, reps):
    """Forward and forward+backward (gradients of every input) times, and the compiled
    forward+backward's temporary + output memory."""
    fwd = jax.jit(lambda x: f(x)[0]).lower(x).compile()
    grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x)[0].astype(jnp.float32) ** 2))).lower(x).compile()
    m = grad.memory_analysis()
    r = dict(op=label, fwd_ms=timeit(fwd, x, reps=reps), fwdbwd_ms=timeit(grad, x, reps=reps),
             fwdbwd_mib=round((m.temp_size_in_bytes + m.output_size_in_bytes) / 2**20)
             if m else None,
             t_s=round(elapsed()))
    print(json.dumps(r), flush=True)
    if PROFILE[0]:
        for part, g in (("fwd", fwd), ("fwdbwd", grad)):
            print(f"{label} {part}: device time by kernel, a call ({reps} traced)")
            print("\n".join(traced_kernels(g, x, reps, f"{PROFILE[0]}/{label}/{part}")), flush=True)
    return r


def traced_kernels(f, x, reps, trace_dir):
    """kernel_times' table of ``reps`` calls of the compiled ``f`` traced into ``trace_dir``."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready([f(x) for _ in range(reps)])
    return kernel_table(trace_events(trace_dir), top=12, steps=reps)


def breakdown(core, x, reps, options):
    """Time each kernel of the split pallas forward+backward alone for one core (dense rows, T a
    multiple of 64) with kernel ``options``: forward = WY (``wy_fwd``, or ``prepare`` in XLA for
    a per-channel decay), serial state pass, chunk outputs; backward = WY again, dO products,
    serial state pass, per-chunk cotangents, WY pullback (``wy_bwd`` or ``prepare``'s vjp). The
    scalar WY kernels sum the log decays in each chunk themselves (v8.8); with a per-channel
    decay ``wy`` and ``wy_pullback`` include the sums γ and dg from dγ and dσ: XLA's unless
    the options say ``decay_scan="mosaic"`` (``/dsm``; until v8.7 an item of its own,
    ``decays``: 0.31-0.37 ms for KDA)."""
    from pallas_kernels import delta_rule as dr
    from pallas_kernels import state_bwd_triton as sb
    from pallas_kernels import state_fwd_triton as sf
    from pallas_kernels import state_mosaic as sm
    from pallas_kernels.triton_common import Dots, interpret_default
    B, T, H, D = x["q"].shape
    nc, decay = T // 64, {None: "none", 3: "scalar", 4: "vector"}[DECAYS[core]]
    options = dr.resolve(options, sixteen_bit=x["q"].dtype.itemsize == 2,  # as the op does
                         mosaic_fits=sm.runs_here(interpret=interpret_default(), chunk=64,
                                                  K=D, V=D),
                         vector_mosaic_fits=dr.vector_mosaic_runs_here(
                             decay=decay, interpret=interpret_default(), chunk=64, K=D, V=D,
                             dtype=x["q"].dtype))
    cfg = dr._Config(64, decay, D ** -0.5, None, options, Dots(options.precision, interpret_default()),
                     Dots(options.parallel_precision, interpret_default()))
    flags = (jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, nc)),
             jnp.broadcast_to((jnp.arange(nc) == 0).astype(jnp.int32), (B, nc)),
             jnp.broadcast_to((jnp.arange(nc) == nc - 1).astype(jnp.int32), (B, nc)))
    ins = (x["q"], x["k"], x["kw"], x["v"], x["beta"], x.get("g"))
    kw = dict(chunk=64, block_v=options.block_v, dots=cfg.dots, num_warps=options.num_warps,
              num_stages=options.num_stages)
    store = dict(state_dtype=jnp.dtype(options.state_dtype))
    pkw = kw | dict(dots=cfg.pdots)  # the chunk-parallel kernels' dots
    skw = kw | dict(block_v=options.serial_block_v or options.block_v, dots=cfg.sdots)  # serial
    mosaic = options.serial_backend == "mosaic"
    pkw |= dict(transposed=mosaic)  # Mosaic passes store states and G transposed
    if mosaic:
        state_fwd = lambda W, U, k, gc: sm.state_fwd(  # noqa: E731
            W, U, k, gc, None, *flags, num_docs=None, interpret=interpret_default())
        state_bwd = lambda W, k, gc, A, G, df: sm.state_bwd(  # noqa: E731
            W, k, gc, A, G, df, *flags, interpret=interpret_default())
    else:
        state_fwd = lambda W, U, k, gc: sf.state_pass(  # noqa: E731
            W, U, k, gc, None, *flags, num_docs=None, **skw, **store)
        state_bwd = lambda W, k, gc, A, G, df: sb.state_pass(  # noqa: E731
            W, k, gc, A, G, df, *flags, **skw, **store)
    steps = dict(
        wy=lambda ins: dr._wy(cfg, ins),
        state_fwd=state_fwd,
        chunk_output=lambda q, P, S, R: sf.chunk_output(q, P, S, R, scale=cfg.scale,
                                                        out_dtype=x["v"].dtype, **pkw),
        dout_products=lambda P, q, do: sb.dout_products(P, q, do, scale=cfg.scale, **pkw, **store),
        state_bwd=state_bwd,
        chunk_grads=lambda *a: sb.chunk_grads(*a, scale=cfg.scale, block_k=options.block_k, **pkw),
        wy_pullback=lambda ins, extra, cts: dr._wy_pullback(cfg, ins, extra)[1](cts))
    f = {n: jax.jit(fn) for n, fn in steps.items()}
    (W, U, kt, qd, P, gc), extra = f["wy"](ins)
    states, R, final = f["state_fwd"](W, U, kt, gc)
    o = f["chunk_output"](qd, P, states, R)
    A, G = f["dout_products"](P, qd, o)
    dU, dstates, _ = f["state_bwd"](W, kt, gc, A, G, final)
    dW, dkt, dq, dP, dgc = f["chunk_grads"](states, dstates, dU, R, o)
    args = dict(wy=(ins,), state_fwd=(W, U, kt, gc), chunk_output=(qd, P, states, R),
                dout_products=(P, qd, o), state_bwd=(W, kt, gc, A, G, final),
                chunk_grads=(states, dstates, dU, R, o),
                wy_pullback=(ins, extra, (dW, dU, dkt, dq, dP, dgc)))
    times = {f"{n}_ms": timeit(f[n], *args[n], reps=reps) for n in steps}
    r = dict(breakdown=core, variant=variant_tag(options), **times, t_s=round(elapsed()))
    print(json.dumps(r), flush=True)
    return r


def variant(v):
    """Options from precision/block_v/num_warps[/num_stages][/fused][/recompute]
    [/vxla|/vkernel|/vhalving|/vmosaic][/pP][/kN][/wkN][/bwN][/wwN][/sN][/hbf16|/h32][/wbf16][/qP]
    [/oserial|/okernel][/dserial|/dkernel][/mosaic|/triton][/cpN][/fg|/nofg][/gw1][/wyP][/waP]
    [/wis][/invm][/ipN][/serp|/infp][/fw1|/fw2][/dsx|/dsm][/vpull|/vkpull] (vxla / vkernel /
    vhalving / vmosaic: ``Options.vector_wy`` = "xla" / "kernel" / "halving" / "mosaic"; pP:
    ``Options.parallel_precision`` = P, e.g. ptf32, pbf16;
    kN: ``Options.block_k`` = N; wkN: ``Options.wy_block_k`` = N; bwN:
    ``Options.pullback_warps`` = N; wwN: ``Options.wy_warps`` = N; sN:
    ``Options.serial_block_v`` = N; hbf16 / h32:
    ``Options.state_dtype`` = "bfloat16" / "float32"; wbf16: ``Options.wy_dtype`` =
    "bfloat16"; qP: ``Options.serial_precision`` = P;
    oserial / okernel: ``Options.output_in_serial`` True / False; dserial / dkernel:
    ``Options.dout_in_serial`` True / False (``breakdown`` ignores both: it times the separate
    kernels);
    mosaic / triton: ``Options.serial_backend``; cpN: ``Options.sequence_pieces`` = N; fg / nofg:
    ``Options.fused_grads`` True / False; gw1:
    ``Options.grads_warpgroups`` = 1; wyP / waP: ``Options.wy_precision`` /
    ``wy_apply_precision`` = P; wis: ``Options.wy_in_serial``; invm:
    ``Options.inverse_backend`` = "mosaic"; ipN: ``Options.inverse_passes`` = N; serp / infp:
    ``Options.p_in_serial`` True / False; fw1 / fw2: ``Options.forward_warpgroups`` = 1 / 2; dsx / dsm:
    ``Options.decay_scan`` = "xla" / "mosaic"; vpull / vkpull: ``Options.vector_pullback`` =
    "mosaic" / "kernel"). Unnamed options keep their
    defaults."""
    f = v.split("/")
    flags = [t for t in f[3:] if not t.isdigit()]
    block_k = [int(t[1:]) for t in flags if t[0] == "k" and t[1:].isdigit()]
    pullback = [int(t[2:]) for t in flags if t[:2] == "bw" and t[2:].isdigit()]
    wy_warps = [int(t[2:]) for t in flags if t[:2] == "ww" and t[2:].isdigit()]
    wy_block_k = [int(t[2:]) for t in flags if t[:2] == "wk" and t[2:].isdigit()]
    parallel = [t[1:] for t in flags if t[0] == "p"]
    serial_dots = [t[1:] for t in flags if t[0] == "q"]
    serial = [int(t[1:]) for t in flags if t[0] == "s" and t[1:].isdigit()]
    pieces = [int(t[2:]) for t in flags if t[:2] == "cp" and t[2:].isdigit()]
    passes = [int(t[2:]) for t in flags if t[:2] == "ip" and t[2:].isdigit()]
    wy_dots = [t[2:] for t in flags if t[:2] == "wy"]
    apply_dots = [t[2:] for t in flags if t[:2] == "wa"]
    stages = int(f[3]) if len(f) > 3 and f[3].isdigit() else Options().num_stages
    return Options(precision=None if f[0] == "auto" else f[0], block_v=int(f[1]),
                   num_warps=int(f[2]), num_stages=stages, split="fused" not in flags,
                   save_wy="recompute" not in flags,
                   vector_wy=next((t[1:] for t in flags
                                   if t in ("vxla", "vkernel", "vhalving", "vmosaic")), None),
                   parallel_precision=parallel[0] if parallel else None,
                   block_k=block_k[0] if block_k else Options().block_k,
                   wy_block_k=wy_block_k[0] if wy_block_k else None,
                   pullback_warps=pullback[0] if pullback else None,
                   wy_warps=wy_warps[0] if wy_warps else None,
                   serial_block_v=serial[0] if serial else None,
                   state_dtype="bfloat16" if "hbf16" in flags else "float32" if "h32" in flags
                   else None, wy_dtype="bfloat16" if "wbf16" in flags else None,
                   serial_precision=serial_dots[0] if serial_dots else None,
                   output_in_serial=True if "oserial" in flags else False if "okernel" in flags
                   else None,
                   dout_in_serial=True if "dserial" in flags else False if "dkernel" in flags
                   else None,
                   serial_backend=next((t for t in flags if t in ("mosaic", "triton")), None),
                   sequence_pieces=pieces[0] if pieces else None,
                   fused_grads=True if "fg" in flags else False if "nofg" in flags else None,
                   grads_warpgroups=1 if "gw1" in flags else 2,
                   wy_precision=wy_dots[0] if wy_dots else None,
                   wy_apply_precision=apply_dots[0] if apply_dots else None,
                   wy_in_serial=True if "wis" in flags else None,
                   inverse_backend="mosaic" if "invm" in flags else None,
                   inverse_passes=passes[0] if passes else None,
                   p_in_serial=True if "serp" in flags else False if "infp" in flags else None,
                   forward_warpgroups=2 if "fw2" in flags else 1 if "fw1" in flags else None,
                   decay_scan="xla" if "dsx" in flags else "mosaic" if "dsm" in flags else None,
                   vector_pullback=("mosaic" if "vpull" in flags else
                                    "kernel" if "vkpull" in flags else None))


def variant_tag(opt):
    """The variant string of Options ``opt`` (``variant``'s inverse, num_stages always shown)."""
    return (f"{opt.precision or 'auto'}/{opt.block_v}/{opt.num_warps}/{opt.num_stages}"
            + ("" if opt.split else "/fused") + ("" if opt.save_wy else "/recompute")
            + ("" if opt.vector_wy is None else f"/v{opt.vector_wy}")
            + (f"/p{opt.parallel_precision}" if opt.parallel_precision else "")
            + (f"/k{opt.block_k}" if opt.block_k != Options().block_k else "")
            + (f"/wk{opt.wy_block_k}" if opt.wy_block_k else "")
            + (f"/bw{opt.pullback_warps}" if opt.pullback_warps else "")
            + (f"/ww{opt.wy_warps}" if opt.wy_warps else "")
            + (f"/s{opt.serial_block_v}" if opt.serial_block_v else "")
            + {"bfloat16": "/hbf16", "float32": "/h32", None: ""}[opt.state_dtype]
            + ("/wbf16" if opt.wy_dtype == "bfloat16" else "")
            + (f"/q{opt.serial_precision}" if opt.serial_precision else "")
            + {True: "/oserial", False: "/okernel", None: ""}[opt.output_in_serial]
            + {True: "/dserial", False: "/dkernel", None: ""}[opt.dout_in_serial]
            + (f"/{opt.serial_backend}" if opt.serial_backend else "")
            + (f"/cp{opt.sequence_pieces}" if opt.sequence_pieces else "")
            + {True: "/fg", False: "/nofg", None: ""}[opt.fused_grads]
            + ("/gw1" if opt.grads_warpgroups == 1 else "")
            + (f"/wy{opt.wy_precision}" if opt.wy_precision else "")
            + (f"/wa{opt.wy_apply_precision}" if opt.wy_apply_precision else "")
            + ("/wis" if opt.wy_in_serial else "")
            + ("/invm" if opt.inverse_backend == "mosaic" else "")
            + (f"/ip{opt.inverse_passes}" if opt.inverse_passes else "")
            + {True: "/serp", False: "/infp", None: ""}[opt.p_in_serial]
            + (f"/fw{opt.forward_warpgroups}" if opt.forward_warpgroups else "")
            + {"xla": "/dsx", "mosaic": "/dsm", None: ""}[opt.decay_scan]
            + {"mosaic": "/vpull", "kernel": "/vkpull", None: ""}[opt.vector_pullback])


def jla_ops():
    """jax-linear-attention's symmetric-key kernels, as (inputs) -> (o, None) functions."""
    from jla.ops import linear_attention

    def make(kind, gate):
        def f(x):
            gates = dict(beta=x["beta"]) if gate is None else dict(beta=x["beta"], g=x["g"])
            o = linear_attention(kind, x["q"], x["k"], x["v"], impl="mosaic_gpu", **gates)[0]
            return o, None
        return f
    return {"deltanet": make("deltanet", None), "gdn": make("gated_deltanet", 3),
            "kda": make("kda", 4)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=(8, 2048, 8, 128))
    p.add_argument("--sections", default="checks,packed,time,rows,jla,chunked,breakdown")
    p.add_argument("--check-dtypes", default="bf16,fp32")
    p.add_argument("--variants", default="auto/64/4",
                   help="kernel options precision/block_v/num_warps[/num_stages]"
                        "[/fused][/recompute][/vxla]...; the first is checked in every "
                        "--check-dtypes (the fused baseline, /fused, is no longer a default "
                        "row: ~100 s of a call for 4-7x numbers known since v4)")
    p.add_argument("--check-all-variants", action="store_true",
                   help="also check the other variants (bf16); by default only the first")
    p.add_argument("--cores", default=",".join(DECAYS),
                   help="cores whose ops the time section times (pallas, rows, jla, chunked)")
    p.add_argument("--check-cores", default=",".join(DECAYS),
                   help="cores the checks section checks (~30 s each in bf16 at the default shape)")
    p.add_argument("--breakdown-cores", default=",".join(DECAYS),
                   help="cores whose kernels ``breakdown`` times, for every variant")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=420,
                   help="start no new item after this many seconds from process start")
    p.add_argument("--poison-gib", type=float, default=4.0)
    p.add_argument("--timing", choices=("sync", "pipelined"), default="sync",
                   help="each call waited for (median), or all queued then waited for (mean)")
    p.add_argument("--gates", type=gates_arg, default="mild",
                   help="decay distribution of the inputs: mild, layer or const:R (make_inputs)")
    p.add_argument("--similar", type=float, default=0.0,
                   help="keys share a direction: mean cosine s^2 / (1 + s^2) (make_inputs)")
    a = p.parse_args()
    POISON_GIB[0] = a.poison_gib
    PIPELINED[0] = a.timing == "pipelined"
    B, T, H, D = a.shape
    sections = a.sections.split(",")
    cores, check_cores = a.cores.split(","), a.check_cores.split(",")
    for flag, given in (("--cores", cores), ("--check-cores", check_cores)):
        if not set(given) <= set(DECAYS):
            p.error(f"{flag} takes {', '.join(DECAYS)}, got {','.join(given)}")
    dev = jax.devices()[0]
    print(json.dumps(dict(device=dev.device_kind, jax=jax.__version__, shape=a.shape,
                          date=time.strftime("%Y-%m-%d %H:%M"))), flush=True)
    key = jax.random.key(int(time.time()))
    results, timings = [], []

    guarded = Guard(a.budget_s)

    variants = [variant(v) for v in a.variants.split(",")]
    names = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
    check_dtypes = [names[d] for d in a.check_dtypes.split(",")]
    inputs = {core: make_inputs(jax.random.fold_in(key, 7), B, T, H, D, decay, jnp.bfloat16,
                                gates=a.gates, similar=a.similar)[0]
              for core, decay in DECAYS.items()} if "time" in sections else {}
    for n_variant, opt in enumerate(variants):
        tag = variant_tag(opt)
        dtypes = check_dtypes if n_variant == 0 else (jnp.bfloat16,) if a.check_all_variants else ()
        for dtype in dtypes if "checks" in sections else ():
            for core in check_cores:
                def one(dtype=dtype, core=core):
                    k1, k2 = jax.random.split(jax.random.fold_in(key, len(results)))
                    x, kc = make_inputs(k1, B, T, H, D, DECAYS[core], dtype, n_docs=B,
                                        gates=a.gates, similar=a.similar)
                    name = f"{core} {jnp.dtype(dtype).name} {tag}"
                    return check(name, op("pallas", opt), op("chunked"), x, kc, dtype)
                results.append(guarded(f"check {tag} {core}", one))
        if n_variant == 0 and "packed" in sections:
            def packed():
                cu = jnp.asarray([0, 1000, 1037, 3001, 5000], jnp.int32)
                x, kc = make_inputs(jax.random.fold_in(key, 999), 1, 5000, H, D, 3, jnp.bfloat16,
                                    n_docs=4)
                return check(f"gdn bf16 {tag} packed T=5000, 4 docs", op("pallas", opt, cu),
                             op("chunked", cu_seqlens=cu), x, kc, jnp.bfloat16)
            results.append(guarded("check packed", packed))
        jobs = [(f"pallas[{tag}] {core}", op("pallas", opt), core) for core in cores]
        if n_variant == 0:  # once: packed rows, jax-linear-attention, the chunked form
            cu = jnp.asarray([0, T], jnp.int32)
            jobs += [(f"pallas[{tag}] {core} rows", rows_op(op("pallas", opt, cu)), core)
                     for core in cores if "rows" in sections]
            jobs += [(f"jla {core} (k̃ = k)", core, core) for core in cores if "jla" in sections]
            jobs += [(f"chunked {core}", op("chunked"), core) for core in cores
                     if "chunked" in sections]
        for label, f, core in jobs if "time" in sections else ():
            timings.append(guarded(f"time {label}", lambda: time_op(
                label, jla_ops()[f] if isinstance(f, str) else f, inputs[core], a.reps)))
    for opt in variants if "breakdown" in sections else ():
        for core in a.breakdown_cores.split(","):
            x, _ = make_inputs(jax.random.fold_in(key, 8), B, T, H, D, DECAYS[core], jnp.bfloat16,
                               gates=a.gates, similar=a.similar)
            guarded(f"breakdown {core}", lambda: breakdown(core, x, a.reps, opt))

    print(f"\n{'check':40s} {'ok':>5s} {'err_o':>9s} {'err_final':>9s} {'err_grad':>9s}")
    for r in filter(None, results):
        print(f"{r['check']:40s} {str(r['ok']):>5s} {r['err_o']:9.2e} {r['err_final']:9.2e} "
              f"{r['err_grad_max']:9.2e}")
    jla = {r["op"].split()[1]: r for r in filter(None, timings) if r["op"].startswith("jla")}
    print(f"\n{'op, bf16 ' + 'x'.join(map(str, a.shape)):40s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} "
          f"{'MiB':>8s} {'fwd/jla':>8s} {'f+b/jla':>8s}")
    for r in filter(None, timings):
        j = jla.get(r["op"].split()[-1] if not r["op"].startswith("jla") else "")
        ratio = (f"{r['fwd_ms'] / j['fwd_ms']:8.2f} {r['fwdbwd_ms'] / j['fwdbwd_ms']:8.2f}" if j
                 else "")
        print(f"{r['op']:40s} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:10.3f} {str(r['fwdbwd_mib']):>8s} "
              f"{ratio}")
    print(f"elapsed {elapsed():.0f} s")


if __name__ == "__main__":
    main()
