"""Public ATK / PDN preconditioner op: the write key k̃ for PDN / PGDN / PKDA (SPEC 3.2)."""

import jax.numpy as jnp

from precond_linattn.chunked.atk import atk_chunked
from precond_linattn.numerics import f32
from precond_linattn.ops.dispatch import choose_impl, pallas_kernel
from precond_linattn.reference.atk import atk_reference, atk_step_fn
from precond_linattn.validation import (
    check_array, check_chunk_size, check_cu_seqlens, check_decay, check_scale, check_tensor)


def check_atk_squash(x, eps, *, prefix: str = "") -> None:
    """The squash hyper-parameters are valid: width x >= 1 and eps > 0, both finite. Traced values
    are trusted; messages name each as ``prefix + name`` (the layer config passes "atk.squash_",
    its field names)."""
    check_scale(f"{prefix}x", x, minimum=1.0)
    check_scale(f"{prefix}eps", eps, minimum=0.0, strict=True)


def atk_precondition(k, log_decay, gain, center, *, x=1.5, eps=1e-6, initial_state=None,
                     output_final_state=False, cu_seqlens=None, impl="auto", chunk_size=64):
    """Write key of the ATK / PDN diagonal preconditioner (SPEC 3.2), per batch row and head:

        A_t  = exp(g_t) ⊙ A_{t−1} + gain_t (k_t ⊙ k_t)
        ρ_t  = log(A_t + eps) − center_h        σ_t = ρ_t / (1 + |ρ_t|)
        k̃_t = exp(−log(x) · σ_t) ⊙ k_t         (uses the current A_t; k̃_t / k_t ∈ [1/x, x])

    Args:
      k: [B, T, H, K] keys.
      log_decay: the preconditioner's own log decay g ≤ 0: [B, T, H] (per head) or [B, T, H, K]
        (per channel); None means no forgetting (g ≡ 0).
      gain: [B, T, H] write gain β^P.
      center: [H] log-space centre c_h (FLA's ``log_atk_scale``, used directly).
      x: squash width, >= 1; x = 1 gives k̃ = k exactly.
      eps: > 0, inside the log.
      initial_state: A_0 [N, H, K] with N = B, or the number of documents with ``cu_seqlens``;
        zeros when None.
      output_final_state: also return the final A [N, H, K] (float32).
      cu_seqlens: [N + 1] offsets of documents packed along T (B must be 1); A restarts at each.
      impl: "auto", "reference", "chunked" or "pallas".
      chunk_size: C for the chunked form.

    Returns:
      (k̃ [B, T, H, K] in k's dtype, final A or None).
    """
    check_array("k", k, 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    check_decay(log_decay, B, T, H, K)
    check_tensor("gain", gain, (B, T, H), "[B, T, H]")
    check_tensor("center", center, (H,), "[H]")
    check_atk_squash(x, eps)
    N = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (N, H, K), "[N, H, K]")
    check_chunk_size(chunk_size)
    if log_decay is None:
        log_decay = jnp.zeros((B, T, H), jnp.float32)
    name = choose_impl("atk_precondition", impl, K=K, dtype=k.dtype, decay=log_decay.ndim)
    if name == "pallas":  # kernels take the inputs in their own dtype
        k_write, final = pallas_kernel("atk_precondition")[1](
            k, log_decay, gain, center, x, eps, initial_state, cu_seqlens, chunk_size)
    else:
        args = (f32(k), f32(log_decay), f32(gain), f32(center), x, eps, f32(initial_state),
                cu_seqlens)
        if name == "chunked":
            k_write, final = atk_chunked(*args, chunk_size)
        else:
            k_write, final = atk_reference(*args)
    return k_write.astype(k.dtype), (final if output_final_state else None)


def atk_step(k, log_decay, gain, center, A, *, x=1.5, eps=1e-6):
    """One decoding step of ``atk_precondition`` for a single token:

        A_t  = exp(g_t) ⊙ A_{t−1} + gain_t (k_t ⊙ k_t)
        k̃_t = exp(−log(x) σ(log(A_t + eps) − c)) ⊙ k_t      σ(ρ) = ρ / (1 + |ρ|)

    k: [B, H, K]; log_decay: None, [B, H] or [B, H, K]; gain: [B, H]; center: [H];
    A: [B, H, K] float32. Returns (k̃ [B, H, K] in k's dtype, new A).
    """
    check_array("k", k, 3, "[B, H, K]")
    B, H, K = k.shape
    if log_decay is not None and (not hasattr(log_decay, "shape")
                                  or tuple(log_decay.shape) not in ((B, H), (B, H, K))):
        raise ValueError(f"log_decay must be None, [B, H] or [B, H, K] = {(B, H)} or {(B, H, K)}, "
                         f"got {getattr(log_decay, 'shape', log_decay)}")
    check_tensor("gain", gain, (B, H), "[B, H]")
    check_tensor("A", A, (B, H, K), "[B, H, K]")
    check_tensor("center", center, (H,), "[H]")
    check_atk_squash(x, eps)
    g = jnp.zeros((B, H), jnp.float32) if log_decay is None else f32(log_decay)
    A, k_write = atk_step_fn(f32(A), f32(k), g, f32(gain), f32(center), x, eps)
    return k_write.astype(k.dtype), A
