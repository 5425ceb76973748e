"""PDN paper, 1B (SPEC 6): PGDN on SlimPajama, 50B tokens at 2048 context, 0.5M tokens a step
(256 rows × 2048, 95,367 steps).

    python -m train --config configs/pdn_1b.py data.params.paths=DIR/*.jsonl \
        data.params.vocab_file=DIR/tokenizer.json [model.kwargs.preconditioner=none]
        [model.preset=kda-1b-pdn]

Per variant: ``model.preset`` gdn-1b-pdn (GDN width 1792, the default) or kda-1b-pdn (KDA width
1680, head 120); ``model.kwargs.preconditioner`` none (baseline) or atk (PGDN / PKDA).
32 micro-batches of 8 rows per step.
"""

from configs._lm import lm_config, text_data
from train.optim import pdn_recipe


def get_config():
    return lm_config("pdn_1b", "gdn-1b-pdn", "atk",
                     text_data("data/slimpajama/*.jsonl", "data/llama-tokenizer.json"),
                     pdn_recipe(total_steps=95367), batch_size=256, seq_len=2048, grad_accum=32)
