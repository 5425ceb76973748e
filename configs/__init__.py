"""Named experiment configs for ``python -m train --config configs/NAME.py``.

    mqar_smoke    DeltaNet and OSDN on a small MQAR task, CPU, minutes (the README's main job)
    mqar_sweep    the PDN paper's MQAR sweeps: DN / PDN / GDN / PGDN, 64 pairs or pairs:length 1:8
    osdn_340m     OSDN paper, 340M on FineWeb-Edu (any backbone / preconditioner by override)
    pdn_340m      PDN paper, 340M on SlimPajama
    osdn_1.3b     OSDN paper, 1.3B OSDN-APF
    pdn_1b        PDN paper, 1B PGDN / PKDA
    _lm           shared pieces of the language-model configs
"""
