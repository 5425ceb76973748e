"""Public delta-rule op (DeltaNet / Gated DeltaNet / KDA core with an optional write key)."""


import jax.numpy as jnp

from precond_linattn.chunked.delta import delta_rule_chunked
from precond_linattn.ops.dispatch import choose_impl, pallas_kernel
from precond_linattn.reference.delta import delta_step, delta_rule_reference
from precond_linattn.numerics import f32
from precond_linattn.validation import (
    check_array, check_chunk_size, check_cu_seqlens, check_decay, check_scale, check_shape,
    check_tensor)


def delta_rule(q, k, v, beta, *, write_key=None, log_decay=None, scale=None, initial_state=None,
               output_final_state=False, cu_seqlens=None, impl="auto", chunk_size=64):
    """Delta rule with read key k and write key k̃ (SPEC section 2).

        S̄_{t-1} = Diag(exp g_t) S_{t-1}     u_t = v_t − S̄_{t-1}ᵀ k_t
        S_t = S̄_{t-1} + β_t k̃_t u_tᵀ        o_t = S_tᵀ (scale · q_t)

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV].
      write_key: k̃ [B, T, H, K]; None means k̃ = k (the plain backbone).
      log_decay: None (DeltaNet), [B, T, HV] (GDN) or [B, T, HV, K] (KDA); g ≤ 0.
      scale: query scale, default K ** -0.5.
      initial_state: [N, HV, K, V] with N = B, or the number of documents with ``cu_seqlens``.
      output_final_state: also return the final states [N, HV, K, V] (float32).
      cu_seqlens: [N + 1] offsets of documents packed along T (B must be 1).
      impl: "auto", "reference", "chunked" or "pallas".
      chunk_size: C for the chunked forms.

    HV, the value heads, is H or a multiple of it (grouped value heads, FLA's convention: value
    head j reads key head j // (HV / H), with its own β, decay and state); the keys and queries
    are then repeated to the value heads before the op (each impl runs HV heads).

    Returns:
      (o [B, T, HV, V] in v's dtype, final state or None).
    """
    check_array("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_tensor("k", k, (B, T, H, K), "[B, T, H, K]")
    HV = value_heads(v, 4, B, H)
    V = v.shape[-1]
    check_tensor("v", v, (B, T, HV, V), "[B, T, HV, V]")
    check_tensor("beta", beta, (B, T, HV), "[B, T, HV]")
    if write_key is not None:
        check_tensor("write_key", write_key, (B, T, H, K), "[B, T, H, K]")
    check_decay(log_decay, B, T, HV, K, "HV")
    N = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    q, k, write_key = to_value_heads(HV, q, k, write_key)
    check_chunk_size(chunk_size)
    if scale is None:
        scale = K ** -0.5
    check_scale("scale", scale)
    name = choose_impl("delta_rule", impl, K=K, V=V, dtype=v.dtype, decay=None if log_decay is None
                       else log_decay.ndim)
    kw = k if write_key is None else write_key
    if name == "pallas":  # kernels take the inputs in their own dtype
        o, final = pallas_kernel("delta_rule")[1](q, k, kw, v, beta, log_decay, scale, initial_state,
                                                  cu_seqlens, chunk_size)
    else:
        args = (f32(q), f32(k), f32(kw), f32(v), f32(beta), f32(log_decay), scale,
                f32(initial_state), cu_seqlens)
        if name == "chunked":
            o, final = delta_rule_chunked(*args, chunk_size)
        else:
            o, final = delta_rule_reference(*args)
    return o.astype(v.dtype), (final if output_final_state else None)


def delta_rule_step(q, k, v, beta, state, *, write_key=None, log_decay=None, scale=None):
    """One decoding step of ``delta_rule`` for a single token.

    q, k, write_key: [B, H, K]; v: [B, HV, V]; beta: [B, HV]; log_decay None, [B, HV] or
    [B, HV, K]; state: [B, HV, K, V] float32 (HV: ``delta_rule``'s grouped value heads). Returns
    (o [B, HV, V] in v's dtype, new state).
    """
    check_array("q", q, 3, "[B, H, K]")
    B, H, K = q.shape
    for name, x in (("k", k), ("write_key", write_key)):
        if x is not None:
            check_tensor(name, x, (B, H, K), "[B, H, K]")
    HV = value_heads(v, 3, B, H)
    check_tensor("v", v, (B, HV, v.shape[-1]), "[B, HV, V]")
    check_tensor("beta", beta, (B, HV), "[B, HV]")
    check_shape("state", state, (B, HV, K, v.shape[-1]), "[B, HV, K, V]")
    if log_decay is not None and tuple(log_decay.shape) not in ((B, HV), (B, HV, K)):
        raise ValueError(f"log_decay must be None, [B, HV] or [B, HV, K], got "
                         f"{tuple(log_decay.shape)}")
    q, k, write_key = to_value_heads(HV, q, k, write_key)
    scale = K ** -0.5 if scale is None else scale
    kw = k if write_key is None else write_key
    S, o, _, _ = delta_step(f32(state), f32(q), f32(k), f32(kw), f32(v), f32(beta), f32(log_decay),
                            scale)
    return o.astype(v.dtype), S


def value_heads(v, ndim, B, H):
    """HV, the value heads of ``v`` (axis ndim − 2): H, or a multiple of it (grouped value
    heads); ValueError otherwise."""
    check_array("v", v, ndim, "[B, T, HV, V]" if ndim == 4 else "[B, HV, V]")
    HV = v.shape[-2]
    if v.shape[0] != B or HV < H or HV % H:
        raise ValueError(f"v must have B = {B} rows and a multiple of q's H = {H} heads (grouped "
                         f"value heads), got shape {tuple(v.shape)}")
    return HV


def to_value_heads(HV, *xs):
    """Each array of ``xs`` (None stays None) with its heads (axis −2) repeated to HV: value head
    j reads key head j // (HV / H)."""
    return tuple(x if x is None or x.shape[-2] == HV else
                 jnp.repeat(x, HV // x.shape[-2], axis=-2) for x in xs)
