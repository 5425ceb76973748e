"""Named experiment configs for ``python -m train`` (filled in by the training-system issue)."""
