"""OSDN paper, 340M (SPEC 6): OSDN on FineWeb-Edu, 20,480 steps × 524,288 tokens (~10.7B).

    python -m train --config configs/osdn_340m.py data.params.paths=DIR/*.jsonl \
        data.params.vocab_file=DIR/tokenizer.json [model.kwargs.preconditioner=none|osgm_apf]
        [model.preset=gdn-340m-osdn|kda-340m-osdn]

Per variant: ``model.kwargs.preconditioner`` none (DeltaNet), osgm (OSDN, the default),
osgm_apf (OSDN-APF); ``model.preset`` picks the backbone (deltanet-340m, gdn-340m-osdn,
kda-340m-osdn). Optimiser: ``train.optim.osdn_recipe``. Documents of up to 4096 tokens, packed
into 128 rows of 4096 per step (the paper packs them into 65,536 tokens per GPU; with states
reset at every boundary the two are the same computation); 16 micro-batches of 8 rows per step
(set ``optim.grad_accum`` for the memory at hand).
"""

from configs._lm import lm_config, text_data
from train.optim import osdn_recipe


def get_config():
    return lm_config("osdn_340m", "deltanet-340m", "osgm",
                     text_data("data/fineweb-edu/*.jsonl", "data/llama-tokenizer.json"),
                     osdn_recipe(total_steps=20480), batch_size=128, seq_len=4096, grad_accum=16)
