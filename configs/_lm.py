"""Shared pieces of the language-model configs (not a config itself: no ``get_config``)."""

import dataclasses

from train.config import (CheckpointConfig, DataSpec, ExperimentConfig, LoggingConfig, ModelSpec, OptimConfig,
                          RunConfig)


def text_data(paths: str, vocab_file: str) -> DataSpec:
    """JSONL documents (field "text") from local ``paths`` with the Llama BPE tokenizer of FLA
    (32,000 ids; ``vocab_file`` is its tokenizer.json), documents of up to ``run.seq_len`` tokens
    packed into rows, every state reset at each boundary."""
    return DataSpec(task="text", params=dict(paths=(paths,), format="jsonl", tokenizer_name="bpe",
                                             vocab_file=vocab_file))


def lm_config(name: str, preset: str, preconditioner: str, data: DataSpec, optim: OptimConfig, *,
              batch_size: int, seq_len: int, grad_accum: int) -> ExperimentConfig:
    """A language-model run on one preset, FSDP over all devices, bf16 compute, checkpoints in
    runs/NAME every 1000 steps, metrics every 10 steps (no held-out evaluation: "text" has none)."""
    return ExperimentConfig(
        name=name,
        model=ModelSpec(preset=preset, kwargs=dict(preconditioner=preconditioner)),
        data=data,
        optim=dataclasses.replace(optim, grad_accum=grad_accum),
        checkpoint=CheckpointConfig(dir=f"runs/{name}/checkpoints", every=1000, keep=3),
        logging=LoggingConfig(dir=f"runs/{name}", every=10),
        run=RunConfig(seed=42, steps=optim.total_steps, batch_size=batch_size, seq_len=seq_len),
    )
