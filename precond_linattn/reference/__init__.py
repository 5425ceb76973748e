"""Token-by-token ``lax.scan`` recurrences: the ground truth every fast path is tested against."""
