"""jax-linear-attention's own DeltaNet train step at bench_train's 340M shape, timed in the same
device run as ours (issue 6's rung 2 compares the two side by side): FLA's DeltaNet-340M shape
(24 blocks of width 1024, 8 heads of 128, SwiGLU 2816, vocabulary 32000, untied, no output
gate: 374.4M parameters), AdamW, random tokens, ``--batch`` x ``--seq`` tokens a step; 2 warm-up
steps, then the median of ``--steps``; the allocator's peak.

Needs jax-linear-attention 0.1.0 and equinox (+ jaxtyping, wadler-lindig, safetensors) on the path:

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl/jla \\
        equinox jaxtyping wadler-lindig safetensors   # and jla's wheel in .whl
    pip install --no-index --no-deps --target /tmp/site_jla .whl/jla/*.whl .whl/jax_linear*.whl
    PYTHONPATH=/tmp/site_jla python3 benchmarks/bench_jla_train.py [--remat none|full] [--layers N]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--remat", default="none")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mlp", type=int, default=2816)
    a = p.parse_args()
    import equinox as eqx
    from jla.models import build_model
    from jla.models.config import AttentionConfig, LinearAttentionConfig, ModelConfig
    from jla.training.step import LossConfig, build_train_step, lm_loss

    heads = dict(num_k_heads=a.heads, num_v_heads=a.heads, head_k_dim=a.head_dim, head_v_dim=a.head_dim)
    config = ModelConfig(
        vocab_size=32000, d_model=a.width, n_layers=a.layers, d_ff=a.mlp, tie_embeddings=False,
        attention=AttentionConfig(num_heads=a.heads, num_kv_heads=a.heads, head_dim=a.head_dim),
        linear_attention=LinearAttentionConfig(**heads, output_gate=False),
        layer_types=("deltanet",) * a.layers, remat=a.remat)
    model = build_model(config, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)
    step = build_train_step(optimizer, lm_loss(LossConfig(impl="auto")))
    ids = jax.random.randint(jax.random.key(1), (1, a.batch, a.seq), 0, 32000)
    batch = {"input_ids": ids, "labels": jnp.roll(ids, -1, axis=-1)}
    key, times, t0 = jax.random.key(2), [], time.perf_counter()
    for i in range(2 + a.steps):
        start = time.perf_counter()
        model, opt_state, metrics, key = step(model, opt_state, batch, key)
        jax.block_until_ready(metrics)
        if i == 0:
            print(f"compiled + first step {time.perf_counter() - t0:.0f} s", flush=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
    print(f"jla deltanet {n / 1e6:.1f}M params, {a.layers} blocks, remat={a.remat}, "
          f"{a.batch}x{a.seq}: step {ms:.1f} ms, {a.batch * a.seq / ms:.1f}k tok/s, "
          f"alloc peak {peak:.1f} GiB, loss {float(metrics['loss']):.3f}", flush=True)


if __name__ == "__main__":
    main()
