"""The sharded train step on 8 fake CPU devices, run by tests/test_train.py in its own process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/train_subprocess.py

On a (data, fsdp, tensor) = (2, 2, 2) mesh, for OSDN and PGDN: every parameter and optimiser
moment is sharded as train.partitioning's rules say; the compiled train step all-gathers only
parameters (rank <= 2), never activations such as the [B, T, H, D] inputs of the recurrent op;
and three training steps give the losses of the same run on one device. The same all-gather
check for OSDN on the Pallas kernels over packed rows (the step vmaps them), its two layers in
a scan. Prints "ok".
"""

import io
import re
import sys

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from rich.console import Console

from train.build import data_spec
from train.config import (DataSpec, ExperimentConfig, LoggingConfig, MeshConfig, ModelSpec,
                          OptimConfig, RunConfig)
from train.data import build_dataset
from train import loop
from train.loop import build, train
from train.step import device_batch

T = 24


def config(preconditioner, backbone, mesh, impl="chunked", packed=False, scan=False):
    """One layer of width 32 (``scan``: two, run as a scan over the layers); MQAR rows, or
    (``packed``) tiny_text rows of packed documents, which the train step vmaps over."""
    data = (DataSpec(task="tiny_text", params=dict(max_docs_per_row=4, max_doc_len=16, num_documents=50))
            if packed else DataSpec(task="mqar", params=dict(vocab_size=64, num_kv_pairs=4)))
    return ExperimentConfig(
        name=preconditioner,
        model=ModelSpec(kwargs=dict(num_layers=1 + scan, hidden_size=32, num_heads=2, backbone=backbone,
                                    preconditioner=preconditioner, impl=impl, chunk_size=16 if packed else 8,
                                    **(dict(vocab_size=260) if packed else {}))),  # 259 bytes: even
        data=data,
        optim=OptimConfig(warmup_steps=1, peak_lr=1e-2),
        mesh=MeshConfig(*mesh),
        logging=LoggingConfig(progress=False),
        run=RunConfig(steps=3, batch_size=8, seq_len=T, compute_dtype="float32", scan_layers=scan))


def check_shardings(setup):
    layer = setup.params["layers"][0]
    expect = {("embeddings", "embedding"): P("tensor", "fsdp"), ("lm_head", "kernel"): P("fsdp", "tensor"),
              ("q_proj", "kernel"): P("fsdp", "tensor"), ("o_proj", "kernel"): P("tensor", "fsdp"),
              ("q_conv1d", "kernel"): P(None, "tensor"), ("b_proj", "kernel"): P("fsdp", "tensor"),
              ("gate", "kernel"): P("fsdp", "tensor"), ("down", "kernel"): P("tensor", "fsdp"),
              ("A_log",): P("tensor"), ("o_norm", "scale"): P(None)}
    nodes = {("embeddings", "embedding"): setup.params["embeddings"]["embedding"],
             ("lm_head", "kernel"): setup.params["lm_head"]["kernel"],
             ("gate", "kernel"): layer["mlp"]["gate_proj"]["kernel"],
             ("down", "kernel"): layer["mlp"]["down_proj"]["kernel"],
             **{key: layer["attn"][key[0]][key[1]] if len(key) == 2 else layer["attn"][key[0]]
                for key in expect if key[0] in layer["attn"]}}
    assert set(expect) - set(nodes) <= {("A_log",)}, set(expect) - set(nodes)  # A_log: GDN only
    for key, spec in expect.items():
        if key not in nodes:
            continue
        value = nodes[key][...]
        assert value.sharding.spec == spec, (key, value.sharding.spec)
        shard = value.addressable_shards[0].data.shape
        divisors = [1 if a is None else setup.mesh.shape[a] for a in spec] + [1] * (value.ndim - len(spec))
        assert shard == tuple(d // n for d, n in zip(value.shape, divisors)), (key, shard)
    mu = setup.opt_state[1][0].mu["layers"][0]["attn"]["q_proj"]["kernel"][...]
    assert mu.sharding.spec == P("fsdp", "tensor"), mu.sharding


def check_hlo(setup, cfg):
    """All-gathers of the compiled step: parameters (rank <= 2) and the per-shard partial results
    of the argmax over the vocabulary-sharded logits ([b, T, tensor]); never activations such as
    the recurrent op's [B, T, H, D] inputs or their chunked [B, N, C, H, D] forms. Unit dims are
    dropped first (a scan over layers gathers each layer's [1, ...] slice inside the loop)."""
    batch = device_batch(next(iter(build_dataset(data_spec(cfg)))), 1, setup.shardings.batch)
    states = setup.shardings.leaves(setup.params, setup.opt_state)
    hlo = setup.train_step.lower(*states, batch).compile().as_text()
    results = re.findall(r"=\s*(.*?)\s*all-gather(?:-start)?\(", hlo)  # the output shape(s)
    shapes = [[int(d) for d in dims.split(",") if d and int(d) != 1]  # a scanned layer's slice: [1, ...]
              for r in results for dims in re.findall(r"\[([\d,]*)\]", r)]
    assert shapes, "expected FSDP all-gathers of the parameters"
    for shape in shapes:
        assert len(shape) <= 2 or shape[-1] <= setup.mesh.shape["tensor"], f"activation all-gather {shape}"


def checked_build(checked):
    """``train.loop.build`` that runs ``check_shardings`` and ``check_hlo`` on the setup it
    returns (the one ``train`` then trains with: its step compiled once, for the HLO and the
    steps alike; the suite's time) and appends the config to ``checked``."""
    def build_and_check(cfg, *, devices=None):
        setup = build(cfg, devices=devices)
        assert dict(setup.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
        check_shardings(setup)
        check_hlo(setup, cfg)
        checked.append(cfg)
        return setup
    return build_and_check


def main():
    devices = jax.devices()
    assert len(devices) == 8
    quiet = Console(file=io.StringIO())
    for preconditioner, backbone in (("osgm", "deltanet"), ("atk", "gdn")):
        cfg = config(preconditioner, backbone, (2, 2, 2))
        checked = []
        loop.build = checked_build(checked)
        try:
            sharded = train(cfg, console=quiet).losses
        finally:
            loop.build = build
        assert checked == [cfg]  # the sharded run's own setup passed the checks
        single = train(config(preconditioner, backbone, (1, 1, 1)), devices=devices[:1], console=quiet).losses
        assert sorted(sharded) == [1, 2, 3]
        np.testing.assert_allclose([sharded[s] for s in (1, 2, 3)], [single[s] for s in (1, 2, 3)], rtol=1e-6)
    # the Pallas kernels (interpret mode) on vmapped packed rows, in a scan over two layers:
    # partitioned, not all-gathered; each layer's parameters gathered inside the loop
    cfg = config("osgm", "deltanet", (2, 2, 2), impl="pallas", packed=True, scan=True)
    check_hlo(build(cfg), cfg)
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
