"""The training and evaluation system.

    python -m train --config configs/NAME.py [--only GLOB] [--distributed] [key=value ...]

Modules, in the order a run uses them:

    config        typed experiment configs, config files (``get_config``, ``VARIANTS``), overrides
    build         config -> data specs (training, held-out) and the model config
    data/         grain pipelines: MQAR (Zoology), text files, tiny corpus, packing, tokenizers
    partitioning  parameter path -> logical axes (the model itself carries no sharding code)
    sharding      logical-axis rules, the (data, fsdp, tensor) mesh, sharded state creation
    optim         optax AdamW with the papers' schedules and weight-decay mask
    step          the loss and the jitted, sharded train / eval steps (FSDP gathers, remat,
                  gradient accumulation, packed rows)
    checkpoint    orbax checkpoints (model, optimiser, step, RNG, data iterator), SIGTERM
    metrics       progress bar, JSONL / TensorBoard, throughput, MFU, the NaN check
    loop          one run: build, resume, train, evaluate, save (``train.loop.train``)
    __main__      the CLI: a config's runs in sequence and a final table
"""
