"""The README's main job: DeltaNet and OSDN on a small built-in MQAR task, on CPU in minutes.

    python -m train --config configs/mqar_smoke.py

Two layers of width 64 (2 heads of 32), float32, chunked ops; sequences of 64 tokens holding 8
key-value pairs over a vocabulary of 128 (Zoology's generator), 400 steps of 64 sequences; both
models train with the same data, seed and optimiser, then the run prints
each one's accuracy on the held-out query positions (Zoology's test seed).
"""

from train.config import DataSpec, ExperimentConfig, LoggingConfig, ModelSpec, OptimConfig, RunConfig

VARIANTS = {"DeltaNet": ["model.kwargs.preconditioner=none"],
            "OSDN": ["model.kwargs.preconditioner=osgm"]}


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="mqar_smoke",
        model=ModelSpec(kwargs=dict(num_layers=2, hidden_size=64, num_heads=2, impl="chunked",
                                    chunk_size=16)),
        data=DataSpec(task="mqar", params=dict(vocab_size=128, num_kv_pairs=8)),
        optim=OptimConfig(peak_lr=3e-3, min_lr=3e-4, warmup_steps=50, weight_decay=0.1),
        logging=LoggingConfig(every=25, eval_every=200, eval_batches=8),
        run=RunConfig(steps=400, batch_size=64, seq_len=64, compute_dtype="float32"),
    )
