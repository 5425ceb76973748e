"""Argument checks for the public ops: each failure is a ValueError naming the argument.

Checks run at trace time on static shapes and dtypes. Value checks (``cu_seqlens`` ordering,
scalar hyper-parameters) run only when the value is concrete; under ``jax.jit`` a traced
``cu_seqlens`` is trusted.
"""

from collections.abc import Sequence

import jax
import numpy as np

from precond_linattn.numerics import SUPPORTED_DTYPES

IMPLS = ("auto", "reference", "chunked", "pallas")


def _concrete(x):
    """The value of ``x`` as a numpy array, or None when it is a tracer."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def check_array(name: str, x, ndim: int, layout: str) -> None:
    """``x`` is a floating array of rank ``ndim`` with a supported dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array of shape {layout}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout} (rank {ndim}), got shape {tuple(x.shape)}")
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{name} has unsupported dtype {x.dtype}; expected one of {names}")


def check_shape(name: str, x, expected: Sequence[int], layout: str) -> None:
    """``x`` has exactly the shape ``expected`` (written as ``layout`` in the message)."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(x.shape)}")


def check_cu_seqlens(cu_seqlens, batch: int, length: int) -> int:
    """Validate packed-document offsets and return the number of documents N.

    ``cu_seqlens`` is a 1-D integer array [0, t_1, ..., T] of N + 1 strictly increasing offsets;
    packed inputs have batch size 1.
    """
    if cu_seqlens is None:
        return batch
    if batch != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (documents packed along T), got B={batch}")
    if not hasattr(cu_seqlens, "shape") or len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be a 1-D integer array of N + 1 >= 2 offsets [0, ..., T]")
    if not np.issubdtype(np.dtype(cu_seqlens.dtype), np.integer):
        raise ValueError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    values = _concrete(cu_seqlens)
    if values is not None:
        if values[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
        if values[-1] != length:
            raise ValueError(f"cu_seqlens must end at T={length}, got {values[-1]}")
        if np.any(np.diff(values) <= 0):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {values.tolist()}")
    return int(cu_seqlens.shape[0]) - 1


def check_scale(name: str, value, *, minimum: float | None = None, strict: bool = False) -> None:
    """A concrete scalar hyper-parameter is finite and above ``minimum``."""
    v = _concrete(value)
    if v is None:
        return
    if v.ndim != 0 or not np.isfinite(v):
        raise ValueError(f"{name} must be a finite scalar, got {value!r}")
    if minimum is not None and (v <= minimum if strict else v < minimum):
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be {op} {minimum}, got {float(v)}")


def check_tensor(name: str, x, expected: Sequence[int], layout: str) -> None:
    """``x`` is a floating array of a supported dtype with exactly the shape ``expected``."""
    check_array(name, x, len(expected), layout)
    check_shape(name, x, expected, layout)


def check_decay(log_decay, B: int, T: int, H: int, K: int, heads: str = "H") -> None:
    """log_decay is None, [B, T, H] (scalar per head) or [B, T, H, K] (per channel); ``heads``:
    the heads' name in the messages ("HV": the value heads of grouped ones)."""
    if log_decay is None:
        return
    if not hasattr(log_decay, "ndim") or log_decay.ndim not in (3, 4):
        raise ValueError(f"log_decay must be None, [B, T, {heads}] (scalar decay, GDN) or [B, T, "
                         f"{heads}, K] (per-channel decay, KDA), got "
                         f"{getattr(log_decay, 'shape', log_decay)}")
    if log_decay.ndim == 3:
        check_tensor("log_decay", log_decay, (B, T, H), f"[B, T, {heads}]")
    else:
        check_tensor("log_decay", log_decay, (B, T, H, K), f"[B, T, {heads}, K]")


def check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
