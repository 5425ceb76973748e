"""Public delta-rule op (DeltaNet / Gated DeltaNet / KDA core with an optional write key)."""


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
      q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H].
      write_key: k̃ [B, T, H, K]; None means k̃ = k (the plain backbone).
      log_decay: None (DeltaNet), [B, T, H] (GDN) or [B, T, H, K] (KDA); g ≤ 0.
      scale: query scale, default K ** -0.5.
      initial_state: [N, H, K, V] with N = B, or the number of documents with ``cu_seqlens``.
      output_final_state: also return the final states [N, H, K, V] (float32).
      cu_seqlens: [N + 1] offsets of documents packed along T (B must be 1).
      impl: "auto", "reference", "chunked" or "pallas".
      chunk_size: C for the chunked forms.

    Returns:
      (o [B, T, H, V] in v's dtype, final state or None).
    """
    check_array("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_tensor("k", k, (B, T, H, K), "[B, T, H, K]")
    check_tensor("v", v, (B, T, H, v.shape[-1]), "[B, T, H, V]")
    V = v.shape[-1]
    check_tensor("beta", beta, (B, T, H), "[B, T, H]")
    if write_key is not None:
        check_tensor("write_key", write_key, (B, T, H, K), "[B, T, H, K]")
    check_decay(log_decay, B, T, H, K)
    N = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (N, H, K, V), "[N, H, K, V]")
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

    q, k, write_key: [B, H, K]; v: [B, H, V]; beta: [B, H]; log_decay None, [B, H] or [B, H, K];
    state: [B, H, K, V] float32. Returns (o [B, H, V] in v's dtype, new state).
    """
    check_array("q", q, 3, "[B, H, K]")
    B, H, K = q.shape
    for name, x in (("k", k), ("write_key", write_key)):
        if x is not None:
            check_tensor(name, x, (B, H, K), "[B, H, K]")
    check_tensor("v", v, (B, H, v.shape[-1]), "[B, H, V]")
    check_tensor("beta", beta, (B, H), "[B, H]")
    check_shape("state", state, (B, H, K, v.shape[-1]), "[B, H, K, V]")
    if log_decay is not None and tuple(log_decay.shape) not in ((B, H), (B, H, K)):
        raise ValueError(f"log_decay must be None, [B, H] or [B, H, K], got {tuple(log_decay.shape)}")
    scale = K ** -0.5 if scale is None else scale
    kw = k if write_key is None else write_key
    S, o, _, _ = delta_step(f32(state), f32(q), f32(k), f32(kw), f32(v), f32(beta), f32(log_decay),
                            scale)
    return o.astype(v.dtype), S
