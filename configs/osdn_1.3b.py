"""OSDN paper, 1.3B (SPEC 6): OSDN-APF on FineWeb-Edu, 100B tokens. The batch is not reported;
the 340M run's 524,288 tokens a step (128 × 4096) gives 190,735 steps.

    python -m train --config configs/osdn_1.3b.py data.params.paths=DIR/*.jsonl \
        data.params.vocab_file=DIR/tokenizer.json [model.kwargs.preconditioner=none|osgm]

The deltanet-1.3b preset carries the paper's 1.3B OSGM settings (beta-free update, learnable
initial scale, APF retention from 0.999). 32 micro-batches of 4 rows per step.
"""

from configs._lm import lm_config, text_data
from train.optim import osdn_recipe


def get_config():
    return lm_config("osdn_1.3b", "deltanet-1.3b", "osgm_apf",
                     text_data("data/fineweb-edu/*.jsonl", "data/llama-tokenizer.json"),
                     osdn_recipe(total_steps=190735), batch_size=128, seq_len=4096, grad_accum=32)
