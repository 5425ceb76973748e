"""FLA's Triton kernels at the benchmark shape, for ratios taken in the same device run as
``bench_delta.py`` / ``bench_ops.py`` (PyTorch; FLA is pure Python: carry its wheel, see
benchmarks/NOTES.md "Running it on the device").

    PYTHONPATH=/tmp/site python3 benchmarks/bench_fla.py [--shape B T H D]
        [--ops delta,gdn,kda,pgdn,pkda] [--reps 20]
    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/bench_fla.py --against DIR  # exactness

Inputs as bench_delta's: unit q and k, v normal, β = σ(x), log decays log σ(x + 4) (per head for
GDN / PGDN and the ATK gates, per channel for KDA), bf16 but for the gates. Times: median of
``--reps`` calls after warm-up (CUDA events), forward and forward+backward (``backward`` of the
output with a fixed random cotangent, gradients of every input); peak memory of the
forward+backward above what the inputs hold. Prints one JSON line per op and a table.
``--against DIR`` times nothing: it runs FLA's DeltaNet / GDN / KDA on the problems that
``bench_ops.py --sections fp32 --save-fp32 DIR`` wrote and prints FLA's bf16 errors against their
fp32 answers beside ours (``against``).

FLA autotunes every kernel on first use, for minutes (466 s for kda, delta, pkda on a fresh
machine: RESULTS run 53), and Triton keeps the choices in ``TRITON_CACHE_DIR``. Unless that is
set, the choices made on the lent H200 (``fla_autotune.tar.gz``, the cache's ``*.autotune.json``
files from run 53) are unpacked into a fresh cache directory first: then only the chosen configs
compile (35 s, run 54). Other devices or Triton builds miss the cache and autotune as usual.
"""

import argparse
import json
import os
import pathlib
import statistics
import tarfile
import tempfile

import torch
import torch.nn.functional as F

GATE_KINDS = {"delta": (), "gdn": ("head",), "kda": ("channel",),
              "pgdn": ("head", "head"), "pkda": ("channel", "head")}


def inputs(B, T, H, D, op, seed=0):
    """(q, k, v, gates..., betas...) as the op takes them positionally after v."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q = F.normalize(rand(B, T, H, D), dim=-1).bfloat16()
    k = F.normalize(rand(B, T, H, D), dim=-1).bfloat16()
    v = rand(B, T, H, D).bfloat16()
    gates = [F.logsigmoid(rand(B, T, H, *((D,) if kind == "channel" else ())) + 4.0)
             for kind in GATE_KINDS[op]]
    betas = [torch.sigmoid(rand(B, T, H)).bfloat16() for _ in range(1 + op.startswith("p"))]
    return [q, k, v, *gates, *betas]


AUTOTUNE_CACHE = pathlib.Path(__file__).with_name("fla_autotune.tar.gz")


def use_autotune_cache():
    """Point ``TRITON_CACHE_DIR`` (unless set) at a fresh directory holding ``AUTOTUNE_CACHE``'s
    autotuning results (module docstring); returns the directory."""
    if "TRITON_CACHE_DIR" not in os.environ:
        root = tempfile.mkdtemp(prefix="fla_triton_cache_")
        with tarfile.open(AUTOTUNE_CACHE) as tar:  # members: .triton_cache/<key>/<kernel>.autotune.json
            tar.extractall(root, filter="data")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, ".triton_cache")
    return os.environ["TRITON_CACHE_DIR"]


def fla_ops(**kw):
    """{op: function(q, k, v, *gates, *betas) -> (output, final state or None)}, FLA 0.6.0's
    chunked kernels called with ``kw`` (e.g. ``output_final_state=True``)."""
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda
    from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule
    from fla.ops.precond_kda import chunk_precond_kda
    return {"delta": lambda q, k, v, b: chunk_delta_rule(q, k, v, b, **kw),
            "gdn": lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, **kw),
            "kda": lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, **kw),
            # (g_atk, g, beta_atk, beta) and (g, g_atk, beta_atk, beta): FLA's argument orders
            "pgdn": lambda q, k, v, g, ga, ba, b: chunk_precond_gated_delta_rule(
                q, k, v, ga, g, ba, b, **kw),
            "pkda": lambda q, k, v, g, ga, ba, b: chunk_precond_kda(q, k, v, g, ga, ba, b, **kw)}


def median_ms(fn, reps):
    """Median milliseconds of ``reps`` calls after three warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(name, op, args, reps):
    """Forward and forward+backward times and the forward+backward's peak extra memory."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    do = torch.randn_like(op(*args)[0])

    def fwd():
        with torch.no_grad():
            op(*args)

    def fwdbwd():
        for a in leaves:
            a.grad = None
        op(*leaves)[0].backward(do)

    r = dict(op=f"fla {name}", fwd_ms=round(median_ms(fwd, reps), 3), fwdbwd_ms=None,
             fwdbwd_mib=None)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:  # FLA 0.6.0 refuses gated backwards on Hopper with Triton < 3.7.1 (its #640)
        r["fwdbwd_ms"] = round(median_ms(fwdbwd, reps), 3)
        r["fwdbwd_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    except RuntimeError as e:
        r["fwdbwd_error"] = str(e)[:200]
    print(json.dumps(r), flush=True)
    return r


BACKBONES = {"deltanet": ("delta", ()), "gdn": ("gdn", ("g",)), "kda": ("kda", ("g",))}


def against(path, ops):
    """FLA's bf16 errors on an ``fp32_record`` (``bench_ops --save-fp32``) of a plain backbone:
    the record's inputs (q, k, v, β bf16; g fp32) and cotangents through FLA's op, output, final
    state and gradients against the record's fp32 answer; printed beside the record's own
    errors (ours and the chunked form's)."""
    from benchmarks import fp32_record
    rec = fp32_record.load(path)
    op, gates = BACKBONES[rec["model"]]
    names = ["q", "k", "v", *gates, "beta"]
    leaves = {n: torch.tensor(rec["x"][n], device="cuda").to(
        torch.float32 if n == "g" else torch.bfloat16).requires_grad_() for n in names}
    o, final = ops[op](*leaves.values())
    r, grads = dict(check=f"{rec['model']} vs fp32 chunked"), rec["grads"]
    try:  # FLA 0.6.0 refuses gated backwards on Hopper with Triton < 3.7.1 (its #640)
        torch.autograd.backward([o, final], [torch.tensor(rec["ct_o"], device="cuda").to(
            o.dtype), torch.tensor(rec["ct_final"], device="cuda")])
    except RuntimeError as e:
        r["fla backward"], grads = str(e)[:200], {}
    host = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
    errs = fp32_record.errors(host(o), host(final), {n: host(leaves[n].grad) for n in grads},
                              rec["ref_o"], rec["ref_final"], grads)
    r.update(rec["errors"], **{"fla bf16": errs})
    print(json.dumps(r), flush=True)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=4, default=(8, 2048, 8, 128))
    p.add_argument("--ops", default=",".join(GATE_KINDS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--against", metavar="DIR", help="instead of timing: FLA's errors on the "
                   "records DIR/{deltanet,gdn,kda}.npz that bench_ops --save-fp32 wrote")
    a = p.parse_args()
    cache = use_autotune_cache()
    import fla
    print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                          fla=getattr(fla, "__version__", "?"), shape=a.shape,
                          triton_cache=cache)), flush=True)
    if a.against:
        ops = fla_ops(output_final_state=True)
        found = [pathlib.Path(a.against, f"{m}.npz") for m in BACKBONES]
        if not any(f.exists() for f in found):
            p.error(f"--against: none of {[str(f) for f in found]} exists")
        for r in [against(f, ops) for f in found if f.exists()]:
            print(f"\n{r['check']}")
            for label, errs in list(r.items())[1:]:
                print(f"  {label:16s} " + (" ".join(f"{n}={e:.2e}" for n, e in errs.items())
                                           if isinstance(errs, dict) else errs))
        return
    ops, rows = fla_ops(), []
    for name in a.ops.split(","):
        try:
            rows.append(bench(name, ops[name], inputs(*a.shape, name), a.reps))
        except Exception as e:  # noqa: BLE001 (one failing op must not end the run)
            print(json.dumps(dict(failed=name, error=f"{type(e).__name__}: {str(e)[:400]}")))
    print(f"\n{'op, bf16 ' + 'x'.join(map(str, a.shape)):32s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} "
          f"{'MiB':>6s}")
    for r in rows:
        print(f"{r['op']:32s} {r['fwd_ms']:8.3f} {str(r['fwdbwd_ms'] or '-'):>10s} "
              f"{str(r['fwdbwd_mib'] or '-'):>6s}")


if __name__ == "__main__":
    main()
