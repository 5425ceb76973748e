"""Shared test helpers: random inputs (never zeros) and error measures."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def rel_err(a, b):
    """max |a − b| / max |b| in float64 numpy."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


class Rand:
    """Random draws for delta-rule inputs, seeded per test."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape, dtype=jnp.float32):
        return jnp.asarray(self.rng.standard_normal(shape), dtype)

    def unit(self, *shape, dtype=jnp.float32):
        x = self.rng.standard_normal(shape)
        return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), dtype)

    def beta(self, *shape, dtype=jnp.float32):
        return jnp.asarray(self.rng.uniform(0.05, 0.95, shape), dtype)

    def log_decay(self, kind, B, T, H, K, dtype=jnp.float32):
        """None, a scalar [B,T,H] or per-channel [B,T,H,K] log decay in [-1.5, -0.01]."""
        if kind is None:
            return None
        shape = (B, T, H) if kind == "scalar" else (B, T, H, K)
        return jnp.asarray(-self.rng.uniform(0.01, 1.5, shape), dtype)

    def delta_inputs(self, B, T, H, K, V, decay=None, dtype=jnp.float32):
        return dict(q=self.unit(B, T, H, K, dtype=dtype), k=self.unit(B, T, H, K, dtype=dtype),
                    v=self.normal(B, T, H, V, dtype=dtype), beta=self.beta(B, T, H, dtype=dtype),
                    write_key=self.unit(B, T, H, K, dtype=dtype) * 1.3,
                    log_decay=self.log_decay(decay, B, T, H, K, dtype))


@pytest.fixture
def rand(request):
    return Rand(zlib.crc32(request.node.nodeid.encode()))


def packed_cu_seqlens(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


jax.config.update("jax_default_matmul_precision", "highest")
