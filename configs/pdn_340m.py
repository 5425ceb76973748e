"""PDN paper, 340M (SPEC 6): PDN on SlimPajama, 15B tokens at 2048 context, 0.5M tokens a step
(256 rows × 2048, 28,610 steps).

    python -m train --config configs/pdn_340m.py data.params.paths=DIR/*.jsonl \
        data.params.vocab_file=DIR/tokenizer.json [model.kwargs.preconditioner=none]
        [model.preset=gdn-340m-pdn|kda-340m-pdn]

Per variant: ``model.kwargs.preconditioner`` none (the DeltaNet / GDN / KDA baseline) or atk
(PDN / PGDN / PKDA, the default); ``model.preset`` picks the backbone. Optimiser:
``train.optim.pdn_recipe`` (warmup 0.5B tokens). 16 micro-batches of 16 rows per step.
"""

from configs._lm import lm_config, text_data
from train.optim import pdn_recipe


def get_config():
    return lm_config("pdn_340m", "deltanet-340m", "atk",
                     text_data("data/slimpajama/*.jsonl", "data/llama-tokenizer.json"),
                     pdn_recipe(total_steps=28610), batch_size=256, seq_len=2048, grad_accum=16)
