"""Inference throughput (SPEC section 7): batch 1, a 2048-token prompt prefilled, then 128 greedy
tokens, the whole loop in one ``jax.jit``; 2 warm-ups, median of 5 runs;
tokens/s = (2048 + 128) / (t_prefill + t_decode). Prefill alone is timed the same way. Every row
is compiled first, then the rows are timed in turn for ``--rounds`` rounds (the device's speed
drifts by several % between minutes: RESULTS runs 118-120 read DeltaNet's decode at 233-246 ms);
a row's figures are its medians over the rounds, and "vs host" the median of each round's ratio
to its host's row, with the rounds' range.

    python benchmarks/bench_generate.py [--presets deltanet-340m] [--preconditioners none osgm]
    python benchmarks/bench_generate.py --tiny     # a small model, a quick check on a CPU
    python benchmarks/bench_generate.py --preconditioners osgm --osgm-variant 2/1/16/8/scalar/p4/cpauto
    (the OSGM kernels' options as bench_osgm's variant strings, e.g. the Picard sweeps)
    python benchmarks/bench_generate.py --fused-decode on off   # decode step: one kernel vs the ops
    (a row per setting; "auto": the layer's default, the fused kernel on a GPU)
"""

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.bench_osgm import variant as osgm_variant
from pallas_kernels.osgm_precond import default_options
from precond_linattn.models import LanguageModel, count_params, decode_state_bytes, generate, preset

PAPER_DELTANET_340M = 784.5  # tokens/s, OSDN paper, H100, HF-style generate


def median_seconds(fn, warmups=2, runs=5):
    for _ in range(warmups):
        jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


FUSED_DECODE = {"auto": None, "on": True, "off": False}  # LayerConfig.fused_decode


def model_for(name, preconditioner, fused_decode="auto", tiny=False):
    """The preset's ``LanguageModel`` with ``LayerConfig.fused_decode`` =
    ``FUSED_DECODE[fused_decode]`` (``tiny``: 2 layers, 128 wide, for a check on a CPU)."""
    config = preset(name, preconditioner)
    layer = dataclasses.replace(config.layer, fused_decode=FUSED_DECODE[fused_decode])
    if tiny:
        layer = dataclasses.replace(layer, hidden_size=128, num_heads=2, head_dim=64)
        config = dataclasses.replace(config, num_layers=2, intermediate_size=256, vocab_size=512)
    return LanguageModel(dataclasses.replace(config, layer=layer), rngs=nnx.Rngs(0))


def timed(name, preconditioner, prompt_len, new_tokens, tiny, fused_decode="auto"):
    """(the row's fixed facts, a function that times it once: (prefill s, whole loop s)); both
    programs compiled here."""
    model = model_for(name, preconditioner, fused_decode, tiny)
    config = model.config
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, prompt_len)),
                         jnp.int32)
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda s, p: nnx.merge(graphdef, s).prefill(p)[0])
    jax.block_until_ready((prefill(state, prompt), generate(model, prompt, new_tokens)))
    suffix = "" if fused_decode == "auto" else f"/fused-{fused_decode}"
    facts = dict(model=f"{name}/{preconditioner}{suffix}", fused_decode=fused_decode,
                 params=count_params(config), state_mib=decode_state_bytes(config).total / 2**20)
    return facts, lambda: (median_seconds(lambda: prefill(state, prompt)),
                           median_seconds(lambda: generate(model, prompt, new_tokens)))


def summary(facts, times, tokens):
    """A row from its rounds' (prefill s, whole loop s): medians over the rounds."""
    prefill = statistics.median(t[0] for t in times)
    total = statistics.median(t[1] for t in times)
    return dict(facts, prefill_ms=1e3 * prefill, decode_ms=1e3 * (total - prefill),
                tok_s=tokens / total, rounds=[tokens / t[1] for t in times])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["deltanet-340m"])
    ap.add_argument("--preconditioners", nargs="+", default=["none", "osgm", "osgm_apf", "atk"])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--osgm-variant", type=osgm_variant,
                    help="the OSGM kernels' options (bench_osgm's variant strings)")
    ap.add_argument("--fused-decode", nargs="+", choices=FUSED_DECODE, default=["auto"],
                    help="LayerConfig.fused_decode of each row: the layer's default (auto), one "
                         "Pallas kernel a decode step (on) or the two ops (off)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each row is timed, the rows in turn (>= 1)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, osgm options "
          f"{a.osgm_variant or 'default'}")
    tokens = a.prompt + a.new_tokens
    with default_options(a.osgm_variant):
        rows = [timed(n, p, a.prompt, a.new_tokens, a.tiny, f) for n in a.presets
                for p, f in itertools.product(a.preconditioners, a.fused_decode)]
        times = [[] for _ in rows]
        for k in range(a.rounds):
            for (facts, time_once), t in zip(rows, times):
                t.append(time_once())
                print(json.dumps(dict(round=k, model=facts["model"], prefill_ms=1e3 * t[-1][0],
                                      tok_s=tokens / t[-1][1])), flush=True)  # a cut call keeps these
    rows = [summary(facts, t, tokens) for (facts, _), t in zip(rows, times)]
    host_of = lambda r: (r["model"].split("/")[0], r["fused_decode"])  # noqa: E731
    base = {host_of(r): r["rounds"] for r in rows if r["model"].split("/")[1] == "none"}
    print(f"{'model':28s} {'params':>8s} {'state MiB':>9s} {'prefill ms':>10s} {'decode ms':>9s} "
          f"{'tok/s':>8s} {'x paper':>7s} {'vs host':>7s} {'range':>13s}")
    for r in rows:
        host = base.get(host_of(r))
        ratios = [x / h for x, h in zip(r["rounds"], host)] if host else [float("nan")]
        print(f"{r['model']:28s} {r['params'] / 1e6:7.1f}M {r['state_mib']:9.2f} {r['prefill_ms']:10.1f} "
              f"{r['decode_ms']:9.1f} {r['tok_s']:8.0f} {r['tok_s'] / PAPER_DELTANET_340M:7.2f} "
              f"{statistics.median(ratios):7.3f} {min(ratios):6.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
