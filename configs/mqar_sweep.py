"""The PDN paper's MQAR sweeps (SPEC 7): DN vs PDN and GDN vs PGDN,

    len64/MODEL/T{256,512,1024,2048}      64 key-value pairs, growing sequence length
    ratio8/MODEL/T{128,...,2048}          pairs : length fixed at 1 : 8 (16 ... 256 pairs)

on Zoology's generator (vocabulary 8192, keys and values from disjoint halves, power-law
queries a = 0.01, random filler, 100,000 training examples) and evaluated on the held-out set
(seed + 10; eval_batches × 64 = 3008 examples, Zoology's 3000 rounded up to whole batches).

    python -m train --config configs/mqar_sweep.py                  # all 36 runs in sequence
    python -m train --config configs/mqar_sweep.py --only 'len64/*' # one sweep
    python -m train --config configs/mqar_sweep.py --only '*/PDN/T512'

The paper does not report the MQAR model; this uses Zoology's small setting: 2 layers of width
128 (2 heads of 64), AdamW peak 1e-3 with cosine decay, 12,000 steps of 64 sequences
(~7.7 epochs), bf16 compute. Sweep ``optim.peak_lr`` as Zoology does for the best of each model.
"""

from train.config import DataSpec, ExperimentConfig, LoggingConfig, ModelSpec, OptimConfig, RunConfig

MODELS = {"DN": ("deltanet", "none"), "PDN": ("deltanet", "atk"),
          "GDN": ("gdn", "none"), "PGDN": ("gdn", "atk")}
SWEEPS = {"len64": [(T, 64) for T in (256, 512, 1024, 2048)],
          "ratio8": [(T, T // 8) for T in (128, 256, 512, 1024, 2048)]}
VARIANTS = {f"{sweep}/{model}/T{T}": [f"model.kwargs.backbone={backbone}",
                                      f"model.kwargs.preconditioner={preconditioner}",
                                      f"run.seq_len={T}", f"data.params.num_kv_pairs={pairs}"]
            for sweep, points in SWEEPS.items() for model, (backbone, preconditioner) in MODELS.items()
            for T, pairs in points}


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="mqar_sweep",
        model=ModelSpec(kwargs=dict(num_layers=2, hidden_size=128, num_heads=2)),
        data=DataSpec(task="mqar", params=dict(vocab_size=8192, num_examples=100_000)),
        optim=OptimConfig(peak_lr=1e-3, min_lr=1e-4, warmup_steps=500, weight_decay=0.1),
        logging=LoggingConfig(every=50, eval_every=2000, eval_batches=47),
        run=RunConfig(steps=12_000, batch_size=64, seq_len=256),
    )
