"""Short causal depthwise convolution with SiLU and a decode cache (FLA's ``ShortConvolution``).

Per channel, with kernel w [W, D] (w_{W−1} multiplies the current token) and documents:

    y_t = SiLU(b + Σ_{j=0}^{W−1} w_{W−1−j} ⊙ x_{t−j})      x_s = 0 for s before t's document

so nothing leaks across the documents packed with ``cu_seqlens``. For decoding, the cache of a
row is its last W − 1 inputs (the "tail", zeros before the document start), kept in a ring of
W slots so that a step writes one slot in place instead of shifting the tail (a shifted copy
is a fresh buffer, which a decoding loop copies back into its carry every step), and reads the
window after that write (a read of the old contents before an in-place write would make XLA
copy the buffer): with ``position`` the tokens stepped since the ring was laid out (``tail``
lays it out for position 0: slot 0 free, slots 1 .. W − 1 the tail oldest first),

    ring[position mod W] ← x_t       window_i = ring[(position + 1 + i) mod W]   i = 0 .. W − 1
    y_t = SiLU(b + Σ_i w_i ⊙ window_i)                          (window_{W−1} = x_t, the newest)
"""

import jax
import jax.numpy as jnp
from flax import nnx

from precond_linattn._typing import Array, Float, Int
from precond_linattn.layers.init import normal
from precond_linattn.varlen import segments


def _bounds(batch: int, length: int, cu_seqlens):
    """Start and end (exclusive) of every document: [N] each (rows without cu_seqlens)."""
    if cu_seqlens is None:
        return jnp.zeros((batch,), jnp.int32), jnp.full((batch,), length, jnp.int32)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    return cu[:-1], cu[1:]


def ring_order(ring: Float[Array, "n w d"], position: Int[Array, " n"], count: int) -> Float[Array, "n c d"]:
    """The ``count`` slots of each row's ring from the oldest, ring[(position + 1 + i) mod W] for
    i = 0 .. count − 1 (the module docstring's window; ``count`` = W − 1: the tail alone)."""
    W = ring.shape[1]
    return jnp.take_along_axis(ring, ((position[:, None] + 1 + jnp.arange(count)) % W)[..., None], axis=1)


class ShortConvolution(nnx.Module):
    def __init__(self, features: int, kernel_size: int, *, use_bias: bool, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.kernel = nnx.Param(normal(rngs.params(), (kernel_size, features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype)) if use_bias else None
        self.kernel_size, self.dtype = kernel_size, dtype

    def _out(self, acc, bias):
        if bias is not None:
            acc = acc + bias.astype(jnp.float32)
        return jax.nn.silu(acc).astype(self.dtype)

    def __call__(self, x: Float[Array, "b t d"], *, cu_seqlens=None) -> Float[Array, "b t d"]:
        """Full sequence; ``cu_seqlens`` (B = 1) restarts the window at every document. Under
        ``jax.checkpoint``: the backward keeps x alone and recomputes the float32 window sums
        (kept, they were W shifted float32 copies of x and the pre-activation: ~0.34 GiB a
        convolution at 8 x 2048 x 1024, benchmarks/NOTES.md session 16)."""
        B, T, _ = x.shape
        seg = segments(B, T, cu_seqlens)
        t = jnp.arange(T)
        pos = t - jax.lax.cummax(jnp.where(seg.first, t, 0), axis=1)  # index within document

        @jax.checkpoint
        def conv(x, w, bias):
            w, xf = w.astype(jnp.float32), x.astype(jnp.float32)
            acc = jnp.zeros_like(xf)
            for j in range(self.kernel_size):
                shifted = jnp.pad(xf, ((0, 0), (j, 0), (0, 0)))[:, :T]
                acc = acc + jnp.where((pos >= j)[..., None], shifted, 0.0) * w[self.kernel_size - 1 - j]
            return self._out(acc, bias)

        return conv(x, self.kernel[...], None if self.bias is None else self.bias[...])

    def tail(self, x: Float[Array, "b t d"], *, cu_seqlens=None) -> Float[Array, "n w d"]:
        """The decode cache after ``x``: every document's ring [N, W, D] at position 0, the last
        W − 1 inputs in slots 1 .. W − 1 (oldest first), zeros in slot 0 and before the start."""
        B, T, _ = x.shape
        start, end = _bounds(B, T, cu_seqlens)
        idx = end[:, None] - self.kernel_size + jnp.arange(self.kernel_size)
        rows = jnp.zeros_like(start) if cu_seqlens is not None else jnp.arange(B)
        vals = x[rows[:, None], jnp.clip(idx, 0, T - 1)]
        keep = (idx >= start[:, None]) & (jnp.arange(self.kernel_size) > 0)
        return jnp.where(keep[..., None], vals, 0).astype(self.dtype)

    def step(self, x: Float[Array, "b d"], ring: Float[Array, "b w d"], position: Int[Array, " b"]):
        """One token: returns (y [B, D], the ring with x written at each row's ``position``, the
        module docstring's step)."""
        W = self.kernel_size
        ring = ring.at[jnp.arange(ring.shape[0]), position % W].set(x.astype(self.dtype))
        window = ring_order(ring, position, W)
        acc = jnp.einsum("bwd,wd->bd", window.astype(jnp.float32),
                         self.kernel[...].astype(jnp.float32))
        return self._out(acc, None if self.bias is None else self.bias[...]), ring
