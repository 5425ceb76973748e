"""Helpers shared by the kernels written for Pallas's Triton lowering (``Dots.nn`` and the inverse
also serve the plain-JAX ``delta_rule.prepare``, batched over leading dims).

The lowering takes 2-D dots only (every dimension >= 16), power-of-two tensor sizes, and no slicing
of loaded values (load the rows you need from a ref instead). float32 dots run on tensor cores at
the precision named here: "tf32" (one pass, operands rounded to 10 mantissa bits), "tf32x3"
(three passes, about fp32), "ieee" (CUDA cores, exact fp32, slow) or "bf16" (operands rounded to
bfloat16, products exact, float32 accumulation: twice tf32's tensor-core rate and half its
operand registers). In interpret mode (CPU) float32 dots are exact fp32 (XLA:CPU has no tf32),
and "bf16" rounds the operands there too. The token-loop kernels (OSGM, ATK) share
``column`` (a scalar out of a loaded per-token row) and ``prefetched_loop``.

Inside ``jax.shard_map(check_vma=True)`` every value carries the mesh axes it varies over
(``jax.typeof(x).mat.varying``): kernel results get theirs from ``out_struct`` and the arguments
of each ``custom_vjp`` are made to agree by ``vary_alike`` (outside shard_map both sets are empty).
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import ManualAxisType

_PRESETS = {
    "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "ieee": lax.DotAlgorithmPreset.F32_F32_F32,
}


@dataclasses.dataclass(frozen=True)
class Dots:
    """How float32 dots inside a kernel are computed (a static, hashable setting)."""

    precision: str = "tf32x3"
    interpret: bool = False

    def __post_init__(self):
        if self.precision not in (*_PRESETS, "bf16"):
            raise ValueError(f"precision must be one of {[*_PRESETS, 'bf16']}, got "
                             f"{self.precision!r}")

    def _prec(self, a, b):
        if a.dtype != jnp.float32 or b.dtype != jnp.float32:
            return None  # 16-bit operands: exact products, float32 accumulation
        return lax.Precision.HIGHEST if self.interpret else _PRESETS[self.precision]

    def _dot(self, a, b, dims, batch=()):
        if self.precision == "bf16":
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        elif a.dtype != b.dtype:
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return lax.dot_general(a, b, (dims, (batch, batch)), precision=self._prec(a, b),
                               preferred_element_type=jnp.float32)

    def nn(self, a, b):
        """a @ b; outside kernels also batched over equal leading dims ([..., m, k] @ [..., k, n])."""
        n = a.ndim - 2
        return self._dot(a, b, ((n + 1,), (n,)), tuple(range(n)))

    def nt(self, a, b):
        """a @ bᵀ."""
        return self._dot(a, b, ((1,), (1,)))

    def tn(self, a, b):
        """aᵀ @ b."""
        return self._dot(a, b, ((0,), (0,)))


MAX_HEAD_DIM = 128  # padded K; larger states do not fit one program's registers


def pow2_dim(n: int) -> int:
    """The head dim a kernel works in: the power of two >= max(n, 16) (zero padding)."""
    return max(16, 1 << (n - 1).bit_length())


def pad_last(x, n):
    """x zero-padded along its last axis to n (None stays None)."""
    return x if x is None or x.shape[-1] == n else jnp.pad(
        x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])


def interpret_default() -> bool:
    """Kernels run in interpret mode unless the default backend is a GPU."""
    return jax.default_backend() != "gpu"


def varying_axes(*xs):
    """The manual mesh axes (inside ``jax.shard_map``) that any array of ``xs`` varies over
    (None skipped): the union of their ``jax.typeof(x).mat.varying``; empty outside shard_map."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in xs if x is not None))


def out_struct(shape, dtype, *inputs):
    """``jax.ShapeDtypeStruct(shape, dtype)`` for a kernel result computed from ``inputs``: it
    varies over ``varying_axes(*inputs)``, as the result of any primitive does."""
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=ManualAxisType(varying=varying_axes(*inputs)))


def vary_alike(*xs):
    """``xs`` (None stays None) each cast to vary over ``varying_axes(*xs)`` by ``lax.pcast(to=
    "varying")``, as JAX casts the operands of a primitive: values unchanged, and the transpose
    sums a cotangent over the axes added, so a ``custom_vjp`` whose cotangents vary like its
    outputs gets arguments of that type."""
    axes = varying_axes(*xs)
    return tuple(None if x is None else lax.pcast(
        x, tuple(sorted(axes - jax.typeof(x).mat.varying)), to="varying") for x in xs)


def iota2(n: int):
    """Row and column indices of an n x n tile."""
    i = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return i, j


def unit_lower_inverse(L, dots: Dots):
    """(I + L)^-1 for strictly lower-triangular C x C tiles L [..., C, C] (C a power of two), by
    block merges: X_n, the inverse of I + L's diagonal blocks of n rows, gives

        X_2n = X_n − X_n (L_n X_n)       (L_n: L's entries below the diagonal n-blocks of each
                                          2n-block, i.e. [[A, 0], [C, B]]⁻¹'s −B⁻¹ C A⁻¹)

    from X_2 = I − L_1 up to X_C: 2 log2(C) − 2 matmuls on tensor cores, each of bounded
    factors. (The doubling product (I − L)(I + L²)(I + L⁴)… is exact in exact arithmetic but
    its powers of L grow like binomials before they cancel: with keys of mean cosine ~0.5 in a
    chunk its float32 result is off by O(1), benchmarks/NOTES.md session 14.)"""
    c = L.shape[-1]
    i, j = iota2(c)
    X = jnp.where(i == j, 1.0, 0.0) - jnp.where(i >> 1 == j >> 1, L, 0.0)
    for s in range(1, c.bit_length() - 1):  # n = 2^s
        Ln = jnp.where((i >> (s + 1) == j >> (s + 1)) & (i >> s != j >> s), L, 0.0)
        X = X - dots.nn(X, dots.nn(Ln, X))
    return X


def doc_columns(seg, doc, first, last):
    """{column index: [B, T, 1] float32} for a ``varlen.segments`` layout's per-token document
    id and first / last flags, as ``aux_rows`` columns."""
    return {i: flag.astype(jnp.float32)[..., None]
            for i, flag in ((doc, seg.doc), (first, seg.first), (last, seg.last))}


def aux_rows(columns, width, like):
    """Per-token float32 rows [B, T, H, width] for the token-loop kernels (read back with
    ``column``): column i is ``columns[i]`` broadcast to ``like``'s shape [B, T, H] (and its
    sharding), 0 where absent."""
    zero = jnp.zeros_like(like, jnp.float32)
    return jnp.stack([zero + columns[i] if i in columns else zero for i in range(width)], axis=-1)


def column(row, i):
    """Column i of a loaded aux row, as a scalar (loaded values cannot be indexed)."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, row.shape, 0) == i, row, 0.0))


def prefetched_loop(n, reverse, prefetch, loads, body, carry):
    """``body(t, rows, carry) -> carry`` for t over [0, n) (descending if ``reverse``), where
    ``rows = loads(t)`` was issued ``prefetch`` iterations earlier (indices clamped into range)."""
    def at(i):
        return jnp.clip(n - 1 - i if reverse else i, 0, n - 1)

    def step(i, state):
        carry, queue = state
        t = at(i)
        carry = body(t, queue[0], carry)
        return carry, (*queue[1:], loads(at(i + prefetch)))

    queue = tuple(loads(at(i)) for i in range(prefetch))
    return lax.fori_loop(0, n, step, (carry, queue))[0]


class TraceDefaults:
    """The value that calls traced inside ``use(value)`` take where they name none (e.g. a
    benchmark sets a kernel's options for every layer of a model): a stack whose top is
    ``current``. Trace-time only: a function jitted and traced before keeps its kernels."""

    def __init__(self, name, kind, value):
        self._name, self._kind, self._stack = name, kind, [value]

    @property
    def current(self):
        return self._stack[-1]

    @contextlib.contextmanager
    def use(self, value):
        """``value`` (a ``kind``; None keeps the current one) as the default inside the block;
        ValueError naming the setter (``name``) for another type."""
        if not isinstance(value, self._kind | None):
            raise ValueError(f"{self._name} takes a {self._kind.__module__}.{self._kind.__name__} "
                             f"or None, got {value!r}")
        self._stack.append(self.current if value is None else value)
        try:
            yield value
        finally:
            self._stack.pop()
