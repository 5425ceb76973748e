"""Public OSGM / OSDN preconditioner op: the write key k̃ for OSDN / OSGDN / OSKDA (SPEC 3.1)."""

import jax

from precond_linattn.chunked.osgm import osgm_chunked
from precond_linattn.numerics import f32
from precond_linattn.ops.dispatch import choose_impl, pallas_kernel
from precond_linattn.reference.osgm import osgm_reference, osgm_step_fn
from precond_linattn.validation import (
    check_array, check_chunk_size, check_cu_seqlens, check_scale, check_tensor)


def check_osgm_hyper(eta, d_min, d_max, beta_aware, eps, *, prefix: str = "") -> None:
    """The OSGM hyper-parameters are valid: eta >= 0, the box 0 < d_min <= d_max (finite), eps > 0,
    beta_aware a bool. Traced values are trusted; messages name each as ``prefix + name`` (e.g.
    "osgm.eta" for the layer config's options)."""
    check_scale(f"{prefix}eta", eta, minimum=0.0)
    check_scale(f"{prefix}d_min", d_min, minimum=0.0, strict=True)
    check_scale(f"{prefix}d_max", d_max)
    if not isinstance(d_min, jax.core.Tracer) and not isinstance(d_max, jax.core.Tracer) \
            and float(d_max) < float(d_min):
        raise ValueError(f"{prefix}d_max must be >= {prefix}d_min, got the empty box "
                         f"[d_min, d_max] = [{float(d_min)}, {float(d_max)}]")
    check_scale(f"{prefix}eps", eps, minimum=0.0, strict=True)
    if not isinstance(beta_aware, bool):
        raise ValueError(f"{prefix}beta_aware must be a bool, got {beta_aware!r}")


def osgm_precondition(k, beta, *, eta=0.003, d_min=0.5, d_max=2.0, retention=None, beta_aware=True,
                      eps=1e-6, initial_state=None, output_final_state=False, cu_seqlens=None,
                      impl="auto", chunk_size=64):
    """Write key of the OSGM / OSDN online diagonal preconditioner (SPEC 3.1), per row and head:

        s_t = k_t ⊙ k_t        n̄_t = max(‖k_t‖², eps)        g_t = β_t (beta-aware) or 1
        k̃_t = d_t ⊙ k_t                                     (the OLD d_t)
        d_{t+1} = clip(r_t d_t + (eta g_t / n̄_t)(1 − g_t ⟨d_t, s_t⟩) s_t, d_min, d_max)

    i.e. one projected gradient step of size eta on h_t(d) = ((1 − β_t⟨d, s_t⟩)² − 1) / (2 n_t)
    (beta-aware), the normalised loss change of the delta-rule write with k̃ = d ⊙ k.

    Args:
      k: [B, T, H, K] keys (the read keys of the delta rule).
      beta: [B, T, H] write strength of the delta rule.
      eta: step size, >= 0; eta = 0 keeps d = initial state (k̃ = k with the default).
      d_min, d_max: the box, 0 < d_min <= d_max.
      retention: [B, T, H] APF retention r_t in (0, 1]; None means r ≡ 1 (vanilla OSDN).
      beta_aware: True for the beta-aware update (the paper's main form), False for beta-free.
      eps: > 0, floor of ‖k_t‖².
      initial_state: d_1 [N, H, K] with N = B, or the number of documents with ``cu_seqlens``;
        ones when None. It is used as given (not clipped) for the first token.
      output_final_state: also return the final d [N, H, K] (float32).
      cu_seqlens: [N + 1] offsets of documents packed along T (B must be 1); d restarts at each.
      impl: "auto", "reference", "chunked" or "pallas".
      chunk_size: C for the chunked form.

    Returns:
      (k̃ [B, T, H, K] in k's dtype, final d or None).
    """
    check_array("k", k, 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    check_tensor("beta", beta, (B, T, H), "[B, T, H]")
    if retention is not None:
        check_tensor("retention", retention, (B, T, H), "[B, T, H]")
    check_osgm_hyper(eta, d_min, d_max, beta_aware, eps)
    N = check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (N, H, K), "[N, H, K]")
    check_chunk_size(chunk_size)
    name = choose_impl("osgm_precondition", impl, K=K, dtype=k.dtype)
    hyper = (eta, d_min, d_max, beta_aware, eps)
    if name == "pallas":  # kernels take the inputs in their own dtype
        k_write, final = pallas_kernel("osgm_precondition")[1](
            k, beta, retention, *hyper, initial_state, cu_seqlens, chunk_size)
    else:
        args = (f32(k), f32(beta), f32(retention), *hyper, f32(initial_state), cu_seqlens)
        if name == "chunked":
            k_write, final = osgm_chunked(*args, chunk_size)
        else:
            k_write, final = osgm_reference(*args)
    return k_write.astype(k.dtype), (final if output_final_state else None)


def osgm_step(k, beta, d, *, eta, d_min, d_max, retention=None, beta_aware=True, eps=1e-6):
    """One decoding step of ``osgm_precondition`` for a single token:

        k̃_t = d_t ⊙ k_t        d_{t+1} = clip(r_t d_t + (eta g_t / n̄_t)(1 − g_t ⟨d_t, s_t⟩) s_t)

    k: [B, H, K]; beta, retention: [B, H]; d: [B, H, K] float32.
    Returns (k̃ [B, H, K] in k's dtype, d_{t+1} float32).
    """
    check_array("k", k, 3, "[B, H, K]")
    B, H, K = k.shape
    check_tensor("beta", beta, (B, H), "[B, H]")
    check_tensor("d", d, (B, H, K), "[B, H, K]")
    if retention is not None:
        check_tensor("retention", retention, (B, H), "[B, H]")
    check_osgm_hyper(eta, d_min, d_max, beta_aware, eps)
    k_write, d = osgm_step_fn(f32(d), f32(k), f32(beta), f32(retention), eta, d_min, d_max,
                              beta_aware, eps)
    return k_write.astype(k.dtype), d
