"""Training and evaluation system (configs, grain pipelines, sharded train step, orbax
checkpoints, metrics, CLI). Not built yet: it is the training-system issue, after the layers."""
