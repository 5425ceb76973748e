"""Training throughput of the 340M presets (issues 6 and 7): the jitted, donated train step of
``train.step`` (AdamW, fp32 weights, bf16 compute) on random tokens, one sequence a row, 8 x 2048
tokens per data-parallel device by default; 2 warm-up steps, then the median step time of
``--steps``; the step's peak device memory; with several models, each one's tokens/s as a ratio
of the first's (one process, one device). Progress goes to stderr every ~10 % of a run's steps.

    python benchmarks/bench_train.py [--preconditioners none osgm] [--remat] [--scan-layers] [--tied]
        [--packed]  # rows as packed documents: cu_seqlens [0, T] each, the ops vmapped over rows
        [--mesh DATA FSDP TENSOR [--mesh ...]]  # --batch rows per data-parallel device
        [--losses N] [--compare-mesh DATA FSDP TENSOR [--no-parity]]
        [--osgm-variant 2/1/16/8/scalar/p4/cpauto]  # OSGM kernel options (bench_osgm's strings)
        [--atk-stream N]  # the ATK phase's Mosaic kernels on XLA GPU stream N (PDN's phase 1)
        [--layers N] [--impl pallas|chunked]  # a memory probe: the peak of an N-block step
        [--profile DIR]  # 3 more steps traced: device time by kernel, the device's idle gaps,
                         # each model's difference by kind of kernel from the first model's
        [--hlo DIR]  # the compiled steps' HLO: what a profile's kernel computes and which
                     # lines made it, `benchmarks/hlo_fusion.py DIR/FILE KERNEL`

Rows are plain [b, T] sequences as in the anchors' runs; ``--packed`` passes each row's document
boundaries (one document a row) so the step takes the packed-documents path of a text corpus
(``train.step``: each row a [1, T] sequence with ``cu_seqlens`` under ``jax.vmap``).

The anchors' shape is FLA's DeltaNet-340M: untied embeddings, 374.4M parameters (the default).

Batches: row r of step s is drawn from the seed (``--seed``, s, r) alone (``random_rows``), so
every mesh sees the same global batches. Every run starts from the same weights (``nnx.Rngs(0)``).
``--losses N`` puts each run's losses of its first N steps, warm-up steps included (step 0's is
the initial weights' loss), in one JSON line per model.

``--compare-mesh`` (issue 7): after the runs on each ``--mesh``, each model runs again on the
compare mesh (usually one device): "weak", the same rows per data-parallel device, for
``--compare-steps``, and "parity", the same global batch as the mesh run, accumulated in
micro-batches of ``--batch`` rows per data-parallel device (``train.step``: the gradient of the same
token-weighted mean, so it fits wherever the mesh run does), for the first N steps. The mesh rows
then show the weak-scaling efficiency (tokens/s per device on the mesh / in the weak run) and the
max |loss difference| against the parity run over the first N steps. In bf16 the two programs
round differently (a 1e-4 relative gradient difference on a CPU), which Adam's first updates
amplify; ``--compute-dtype float32`` separates that from a real mismatch.

Memory: "XLA GiB" is the compiled step's peak per device (XLA's buffer assignment: arguments,
results and temporaries); "alloc GiB" is the allocator's peak over the run's devices since the
process started (exact for the first run only: later runs show the largest so far).
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.bench_osgm import variant as osgm_variant
from benchmarks.kernel_times import diff_table, idle_table, kernel_table, trace_events
from pallas_kernels import atk_precond
from pallas_kernels.osgm_precond import default_options
from precond_linattn.models import LanguageModel, count_params, preset
from train.build import flops_per_token
from train.optim import make_optimizer, osdn_recipe
from train.partitioning import annotate
from train.sharding import drop_mesh_axis, init_sharded, logical_sharding, make_mesh, state_shardings
from train.step import StepShardings, device_batch, make_train_step
from train.xla_flags import set_command_buffers

WARMUP = 2  # untimed steps after compilation
PROFILE_STEPS = 3  # the steps --profile traces after a run's timed ones
SCHEDULE_STEPS = 20480  # the recipe's run length: the learning-rate schedule is the real run's


def model_config(name, preconditioner, dtype, tied, tiny, layers=None, impl=None):
    """The preset's config computing in ``dtype`` (``--tiny``: 2 layers of width 128, 2 heads,
    vocabulary 512), with ``layers`` blocks and the ops' ``impl`` if given (``--layers``,
    ``--impl``: a memory probe compares the compiled peaks of few-layer steps)."""
    config = dataclasses.replace(preset(name, preconditioner, dtype=jnp.dtype(dtype)), tie_embeddings=tied)
    if tiny:
        layer = dataclasses.replace(config.layer, hidden_size=128, num_heads=2, head_dim=64)
        config = dataclasses.replace(config, layer=layer, num_layers=2, intermediate_size=256,
                                     vocab_size=512)
    if layers is not None:
        config = dataclasses.replace(config, num_layers=layers)
    if impl is not None:
        config = dataclasses.replace(config, layer=dataclasses.replace(config.layer, impl=impl))
    return config


def random_rows(seed, step, first_row, rows, vocab_size, seq_len):
    """Tokens [rows, seq_len + 1]: row i is global row r = first_row + i of step ``step``, drawn
    uniformly from [0, vocab_size) by ``np.random.default_rng([seed, step, r])`` alone."""
    draw = lambda r: np.random.default_rng([seed, step, r]).integers(0, vocab_size, seq_len + 1, np.int32)
    return np.stack([draw(r) for r in range(first_row, first_row + rows)])


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run: its ``kind`` ("mesh", "weak" or "parity", module docstring), the
    (data, fsdp, tensor) ``mesh`` of the first prod(mesh) devices, ``rows`` in the global batch,
    split into ``micro_batches`` accumulated ones, and ``steps`` steps in all (the first
    ``WARMUP`` untimed)."""

    kind: str
    mesh: tuple
    rows: int
    micro_batches: int
    steps: int

    @property
    def label(self):
        batch = f" B{self.rows}" if self.kind == "parity" else ""
        return f"{self.kind} {','.join(map(str, self.mesh))}{batch}"


def train_run(name, config, run: RunSpec, seq_len, *, remat, scan_layers, packed, lr_warmup, seed,
              profile=None, hlo=None):
    """Trains a fresh ``config`` model (the same initial weights on any mesh) for ``run.steps``
    steps of ``random_rows`` batches (with ``packed``, each row one document of a packed batch).
    Returns the median step time of the steps after ``WARMUP``, tokens/s in all and per device,
    TFLOP/s, the peak memories (module docstring), the compile time and the loss of every step
    (before its update). Prints ``name``, the step, its loss and the tokens/s since the last such
    line to stderr every ~10 % of steps. ``profile``: a directory where ``PROFILE_STEPS`` more
    steps, untimed, are traced (``jax.profiler``); their device time by kernel and the device's
    idle gaps are printed (``kernel_times``)."""
    n_dev = math.prod(run.mesh)
    mesh = make_mesh(*run.mesh, devices=jax.devices()[:n_dev])
    tx = make_optimizer(osdn_recipe(SCHEDULE_STEPS, warmup_steps=lr_warmup))
    model = init_sharded(lambda: annotate(LanguageModel(config, rngs=nnx.Rngs(0))), mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_shardings = state_shardings(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    p_shardings = state_shardings(params, mesh)
    shardings = StepShardings(p_shardings, opt_shardings, drop_mesh_axis(p_shardings, "fsdp"),
                              logical_sharding(mesh, (None, "batch")),
                              NamedSharding(mesh, PartitionSpec()))
    local_rows = run.rows // jax.process_count()
    first_row = jax.process_index() * local_rows

    def batch(step):
        tokens = random_rows(seed, step, first_row, local_rows, config.vocab_size, seq_len)
        rows = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:])
        if packed:
            rows["cu_seqlens"] = np.tile(np.int32([0, seq_len]), (local_rows, 1))
        return device_batch(rows, run.micro_batches, shardings.batch)

    b = batch(0)
    params, opt_state = shardings.leaves(params, opt_state)  # the step's form (train.step)
    t0 = time.perf_counter()
    step = make_train_step(graphdef, tx, shardings, remat=remat,
                           scan_layers=scan_layers).lower(params, opt_state, b).compile()
    compile_s = time.perf_counter() - t0
    if hlo:  # the optimised HLO, to read the profile's fusion names against
        os.makedirs(os.path.dirname(hlo) or ".", exist_ok=True)
        with open(hlo, "w") as f:
            f.write(step.as_text())
    progress(f"{name} {run.label}: compiled in {compile_s:.1f} s")
    tokens = run.rows * seq_len
    every = max(1, round(run.steps / 10))
    times, losses, since = [], [], time.perf_counter()
    for i in range(run.steps):
        b = batch(i) if i else b
        t0 = time.perf_counter()
        params, opt_state, m = step(params, opt_state, b)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
        if (i + 1) % every == 0 or i + 1 == run.steps:
            progress(f"{name} {run.label}: step {i + 1}/{run.steps} loss {losses[-1]:.4f} "
                     f"{tokens * (i % every + 1) / (time.perf_counter() - since):.0f} tok/s")
            since = time.perf_counter()
    if profile:  # steps after the timed ones, traced back to back as a training loop runs them
        with jax.profiler.trace(profile, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for i in range(run.steps, run.steps + PROFILE_STEPS):
                params, opt_state, m = step(params, opt_state, batch(i))
            jax.block_until_ready(m)
            queued_ms = (time.perf_counter() - t0) / PROFILE_STEPS * 1e3
        print(f"{name} {run.label}: device time by kernel, a step ({PROFILE_STEPS} traced, queued "
              f"without waiting: {queued_ms:.1f} ms a step)", flush=True)
        events = trace_events(profile)
        tables = kernel_table(events, steps=PROFILE_STEPS) + idle_table(events, steps=PROFILE_STEPS)
        print("\n".join(tables), flush=True)
    t = statistics.median(times[WARMUP:])
    stats = [d.memory_stats() for d in mesh.devices.flat]
    n = count_params(config)
    out = dict(params=n, step_ms=1e3 * t, tok_s=tokens / t, tok_s_dev=tokens / t / n_dev,
               tflops=flops_per_token(config, n) * tokens / t / 1e12,
               xla_gib=getattr(step.memory_analysis(), "peak_memory_in_bytes", math.nan) / 2**30,
               alloc_gib=max(s["peak_bytes_in_use"] for s in stats) / 2**30 if all(stats) else math.nan,
               compile_s=compile_s, losses=losses, packed="cu_seqlens" in b)
    progress(f"{name} {run.label}: " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()
                                                  if k not in ("losses", "packed")))
    return out


def progress(line):
    """``line`` on stderr at once (for a person watching a long run)."""
    print(line, file=sys.stderr, flush=True)


def data_parallel(mesh):
    """Devices that split the batch: data x fsdp."""
    return mesh[0] * mesh[1]


def plan(a):
    """The ``RunSpec``s of one model: one per ``--mesh``, then (``--compare-mesh``) "weak" and
    one "parity" run per distinct global batch of the meshes."""
    runs = [RunSpec("mesh", m, a.batch * data_parallel(m), 1, a.steps + WARMUP) for m in a.mesh]
    c = a.compare_mesh
    if c is None:
        return runs
    runs.append(RunSpec("weak", c, a.batch * data_parallel(c), 1, a.compare_steps + WARMUP))
    if not a.no_parity:
        for rows in dict.fromkeys(a.batch * data_parallel(m) for m in a.mesh):
            micro_batches = rows // (a.batch * data_parallel(c))
            runs.append(RunSpec("parity", c, rows, micro_batches, max(a.losses, WARMUP + 1)))
    return runs


def print_model(model, runs, results, losses):
    """Table rows of one model's runs (the mesh rows with weak-scaling efficiency and max |loss
    difference| when there are compare runs) and its JSON line: the first ``losses`` losses of
    each run, whether its rows were packed, and the two comparisons."""
    weak = next((res for r, res in zip(runs, results) if r.kind == "weak"), None)
    parity = {r.rows: res for r, res in zip(runs, results) if r.kind == "parity"}
    summary = dict(model=model, params=results[0]["params"], losses_include_warmup=True,
                   losses={r.label: res["losses"][:losses] for r, res in zip(runs, results)},
                   packed={r.label: res["packed"] for r, res in zip(runs, results)},
                   weak_scaling={}, max_abs_loss_diff={}, max_rel_loss_diff={})
    for r, res in zip(runs, results):
        eff = diff = math.nan
        if r.kind == "mesh" and weak is not None:
            eff = summary["weak_scaling"][r.label] = res["tok_s_dev"] / weak["tok_s_dev"]
        if r.kind == "mesh" and r.rows in parity:
            got, want = np.array(res["losses"][:losses]), np.array(parity[r.rows]["losses"][:losses])
            diff = summary["max_abs_loss_diff"][r.label] = float(np.abs(got - want).max())
            summary["max_rel_loss_diff"][r.label] = float((np.abs(got - want) / np.abs(want)).max())
        rows_dev = f"{r.rows // data_parallel(r.mesh) // r.micro_batches}x{r.micro_batches}"
        print(f"{model:20s} {r.label:18s} {rows_dev:>8s} {res['step_ms']:8.1f} {res['tok_s']:9.0f} "
              f"{res['tok_s_dev']:9.0f} {res['tflops']:7.1f} {res['xla_gib']:7.2f} {res['alloc_gib']:9.2f} "
              f"{res['compile_s']:9.1f} {res['losses'][-1]:7.3f} {eff:6.3f} {diff:10.2e}", flush=True)
    print(json.dumps(summary), flush=True)


def parse_args(argv=None):
    """The command line's options; exits (status 2, naming the option) where they do not fit
    together or the meshes need more devices than there are."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="deltanet-340m")
    ap.add_argument("--preconditioners", nargs="+", default=["none", "osgm"])
    ap.add_argument("--batch", type=int, default=8, help="rows per data-parallel device")
    ap.add_argument("--mesh", type=int, nargs=3, action="append", metavar=("DATA", "FSDP", "TENSOR"),
                    help="device mesh (the first DATA x FSDP x TENSOR devices); repeat for several "
                         "(default 1 1 1)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5, help=f"timed steps after {WARMUP} warm-up steps")
    ap.add_argument("--losses", type=int, default=0, help="print the losses of the first N steps")
    ap.add_argument("--compare-mesh", type=int, nargs=3, metavar=("DATA", "FSDP", "TENSOR"),
                    help="rerun on this mesh: same rows per device (weak scaling) and same global "
                         "batch (loss parity)")
    ap.add_argument("--compare-steps", type=int, default=20, help="timed steps of the weak-scaling run")
    ap.add_argument("--no-parity", action="store_true", help="skip the same-global-batch runs")
    ap.add_argument("--lr-warmup", type=int, default=osdn_recipe().warmup_steps,
                    help="learning-rate warm-up steps (the recipe's by default)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random batches")
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the layers' compute dtype (weights are float32 either way)")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--scan-layers", action="store_true",
                    help="the blocks as a lax.scan over stacked parameters (one block to compile)")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--packed", action="store_true",
                    help="rows as packed documents (cu_seqlens, the ops vmapped over rows)")
    ap.add_argument("--tiny", action="store_true", help="a small model, a quick check on a CPU")
    ap.add_argument("--layers", type=int, help="blocks of the model (default: the preset's)")
    ap.add_argument("--impl", choices=["auto", "pallas", "chunked"],
                    help="the ops' impl (default: the preset's)")
    ap.add_argument("--osgm-variant", type=osgm_variant,
                    help="the OSGM kernels' options, as bench_osgm's variant strings")
    ap.add_argument("--atk-stream", type=int, metavar="N",
                    help="the ATK kernels' calls on XLA GPU stream N (atk_precond.Options.stream)")
    ap.add_argument("--hlo", metavar="DIR", help="write each run's compiled step (optimised HLO "
                    "text) to DIR/<preconditioner>_<run>.hlo.txt")
    ap.add_argument("--profile", metavar="DIR",
                    help=f"trace {PROFILE_STEPS} more steps of each run into DIR/<model> and print "
                         "their device time by kernel and the device's idle gaps")
    ap.add_argument("--command-buffers", action="store_true",
                    help="keep XLA's command buffers (CUDA graphs) on, as `python -m train "
                         "--command-buffers` does (off by default, as in the training CLI)")
    a = ap.parse_args(argv)
    set_command_buffers(a.command_buffers)  # before the mesh checks below start the backend
    a.mesh = [tuple(m) for m in a.mesh or [(1, 1, 1)]]
    try:
        a.atk_options = None if a.atk_stream is None else atk_precond.Options(stream=a.atk_stream)
    except ValueError as e:
        ap.error(f"--atk-stream {a.atk_stream}: {e}")
    a.compare_mesh = tuple(a.compare_mesh) if a.compare_mesh else None
    if min(a.batch, a.seq_len, a.steps, a.compare_steps, 1 if a.layers is None else a.layers) < 1:
        ap.error("--batch, --seq-len, --steps, --compare-steps and --layers must be >= 1")
    if not 0 <= a.losses <= a.steps + WARMUP:
        ap.error(f"--losses {a.losses}: must be in [0, {a.steps + WARMUP}] (--steps + {WARMUP} warm-ups)")
    if not 0 <= a.lr_warmup < SCHEDULE_STEPS:
        ap.error(f"--lr-warmup {a.lr_warmup}: must be in [0, {SCHEDULE_STEPS}) (the schedule's length)")
    meshes = [("--mesh", m) for m in a.mesh] + [("--compare-mesh", a.compare_mesh)] * bool(a.compare_mesh)
    for option, mesh in meshes:
        if min(mesh) < 1 or math.prod(mesh) > jax.device_count():
            ap.error(f"{option} {' '.join(map(str, mesh))}: needs sizes >= 1 and at most "
                     f"{jax.device_count()} devices in all")
    if a.compare_mesh and not a.no_parity:
        if a.losses < 1:
            ap.error("--compare-mesh needs --losses N >= 1 for the loss parity (or pass --no-parity)")
        c = data_parallel(a.compare_mesh)
        for m in a.mesh:
            if data_parallel(m) % c:
                ap.error(f"--compare-mesh {' '.join(map(str, a.compare_mesh))}: its {c} data-parallel "
                         f"devices do not divide the {data_parallel(m)} of --mesh {' '.join(map(str, m))} "
                         "(or pass --no-parity)")
    return a


def main():
    a = parse_args()
    configs = {p: model_config(a.preset, p, a.compute_dtype, a.tied, a.tiny, a.layers, a.impl)
               for p in a.preconditioners}
    runs = plan(a)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {a.compute_dtype} compute, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"remat={a.remat}, scan_layers={a.scan_layers}, packed={a.packed}, osgm options "
          f"{a.osgm_variant or 'default'}, ATK options {a.atk_options or 'default'}, {a.seq_len} tokens "
          f"a row, lr warm-up {a.lr_warmup} steps; meshes (data, fsdp, tensor); rows/dev: rows per "
          "data-parallel device x micro-batches")
    print(f"{'model':20s} {'run':18s} {'rows/dev':>8s} {'step ms':>8s} {'tok/s':>9s} {'tok/s/dev':>9s} "
          f"{'TFLOP/s':>7s} {'XLA GiB':>7s} {'alloc GiB':>9s} {'compile s':>9s} {'loss':>7s} {'weak':>6s} "
          f"{'max|dloss|':>10s}", flush=True)
    first_runs = {}  # each model's first run (its first mesh), for the ratios at the end
    with default_options(a.osgm_variant), atk_precond.default_options(a.atk_options):
        for p, config in configs.items():
            name = f"{a.preset}/{p}"
            results = [train_run(name, config, r, a.seq_len, remat=a.remat,
                                 scan_layers=a.scan_layers, packed=a.packed,
                                 lr_warmup=a.lr_warmup, seed=a.seed,
                                 profile=a.profile and os.path.join(a.profile, p),
                                 hlo=a.hlo and os.path.join(a.hlo, f"{p}_{r.kind}.hlo.txt"))
                       for r in runs]
            print_model(name, runs, results, a.losses)
            first_runs[name] = results[0]
    for line in ratio_lines(first_runs, runs[0].label):
        print(line, flush=True)
    if a.profile and len(configs) > 1:
        print("\n".join(profile_diffs(a.profile, a.preset, list(configs))), flush=True)


def ratio_lines(first_runs, label):
    """Lines: each model's tokens/s as a ratio of the first model's and its XLA GiB as a
    difference, from their runs ``label`` (one process, so one device: the ratio issue 6 asks
    for); none for one model."""
    (base_name, base), *others = first_runs.items()
    return [f"{name} / {base_name} ({label}): tokens/s {res['tok_s'] / base['tok_s']:.3f}x, "
            f"XLA GiB {res['xla_gib'] - base['xla_gib']:+.2f}" for name, res in others]


def profile_diffs(profile, preset, models):
    """Lines: each model's traced steps against the first model's, by kind of kernel
    (``kernel_times.diff_table``; the newest trace under each model's directory)."""
    lines, (first, *others) = [], models
    base = trace_events(os.path.join(profile, first))
    for p in others:
        lines.append(f"{preset}/{p} against {preset}/{first}: device time by kind, a step")
        lines += diff_table(trace_events(os.path.join(profile, p)), base, steps=PROFILE_STEPS)
    return lines


if __name__ == "__main__":
    main()
