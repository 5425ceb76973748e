"""The papers' model sizes (SPEC section 6), each buildable for every preconditioner.

    preset           backbone  layers  width  heads  head K  V       source
    deltanet-340m    DeltaNet  24      1024   8      128     128     both papers (DN / OSDN / PDN)
    gdn-340m-osdn    GDN       21      1024   6      128     256     OSDN paper
    kda-340m-osdn    KDA       23      1024   8      128     128     OSDN paper
    gdn-340m-pdn     GDN       24      1024   8      128     128     PDN paper
    kda-340m-pdn     KDA       24      1024   8      128     128     PDN paper ("~355M")
    gdn-1b-pdn       GDN       24      1792   14     128     128     PDN paper
    kda-1b-pdn       KDA       24      1680   14     120     120     PDN paper
    deltanet-1.3b    DeltaNet  24      2048   16     128     128     OSDN paper (OSDN-APF at 1.3B)

Common: vocabulary 32,000 (FLA's Llama tokenizer), SwiGLU with FLA's width rule, short conv 4,
norm eps 1e-6, tied embeddings. Tying is what the papers' size names count: untied, every
340M shape lands 32.8M (one 32000 × 1024 matrix) higher, e.g. DeltaNet 374M, while tied it is 342M
and the PDN KDA shape 354M, matching the PDN paper's "~355M". The GDN-340M head shape of the
OSDN paper (K = 128, V = 256) follows its reported state size (7.875 MiB in bf16 over 21 layers ×
6 heads). SPEC does not give the depth of the PDN 1B models; 24 layers are assumed.
DeltaNet has no output gate (FLA's DeltaNet-340M config), GDN a SiLU gate, KDA its sigmoid gate.
The 1.3B preset's OSGM defaults are the paper's 1.3B settings: the beta-free update and a learnable
initial scale (and APF's retention gate starting at 0.999 with "osgm_apf").
"""

import jax.numpy as jnp

from precond_linattn.layers.config import LayerConfig, OSGMConfig
from precond_linattn.models.config import ModelConfig

VOCAB_SIZE = 32000
PRESETS = {
    "deltanet-340m": dict(backbone="deltanet", num_layers=24, hidden_size=1024, num_heads=8),
    "gdn-340m-osdn": dict(backbone="gdn", num_layers=21, hidden_size=1024, num_heads=6, head_dim=128,
                          expand_v=2.0),
    "kda-340m-osdn": dict(backbone="kda", num_layers=23, hidden_size=1024, num_heads=8),
    "gdn-340m-pdn": dict(backbone="gdn", num_layers=24, hidden_size=1024, num_heads=8),
    "kda-340m-pdn": dict(backbone="kda", num_layers=24, hidden_size=1024, num_heads=8),
    "gdn-1b-pdn": dict(backbone="gdn", num_layers=24, hidden_size=1792, num_heads=14),
    "kda-1b-pdn": dict(backbone="kda", num_layers=24, hidden_size=1680, num_heads=14),
    "deltanet-1.3b": dict(backbone="deltanet", num_layers=24, hidden_size=2048, num_heads=16,
                          osgm=OSGMConfig(beta_aware=False, learn_init_scale=True)),
}
NOMINAL_PARAMS = {"deltanet-340m": 340e6, "gdn-340m-osdn": 340e6, "kda-340m-osdn": 340e6,
                  "gdn-340m-pdn": 340e6, "kda-340m-pdn": 340e6, "gdn-1b-pdn": 1e9, "kda-1b-pdn": 1e9,
                  "deltanet-1.3b": 1.3e9}


def preset(name: str, preconditioner: str = "none", *, dtype=jnp.bfloat16, impl: str = "auto",
           **layer_options) -> ModelConfig:
    """The ``ModelConfig`` of preset ``name`` with ``preconditioner`` ("none", "osgm", "osgm_apf",
    "atk"); ``layer_options`` override ``LayerConfig`` fields (e.g. ``osgm=OSGMConfig(...)``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {tuple(PRESETS)}")
    options = dict(PRESETS[name])
    num_layers = options.pop("num_layers")
    if not preconditioner.startswith("osgm"):
        options.pop("osgm", None)
    options.update(layer_options)
    layer = LayerConfig(preconditioner=preconditioner, norm_eps=1e-6, dtype=dtype, impl=impl, **options)
    return ModelConfig(vocab_size=VOCAB_SIZE, num_layers=num_layers, layer=layer, tie_embeddings=True)
