"""Fused forward of the chunked delta core (SPEC 2.1), Pallas Triton lowering.

One program per (batch row b, head h, V tile); the float32 state S [K, BV] stays in registers
while the program walks the chunks of its row in order. Per chunk (rows t0 .. t0 + C − 1, γ the
cumulative log decay from the chunk start, Γ = exp γ):

    S   ← initial[doc] (or 0) if the chunk starts a document
    L   = strict_tril(β_i ⟨k_i ⊙ Γ_i/Γ_j, k̃_j⟩)      P = tril(⟨q_i ⊙ Γ_i/Γ_j, k̃_j⟩)
    T   = (I + L)^-1                                  (block merges, triton_common)
    W   = T Diag(β)(K ⊙ Γ)     U = T Diag(β) V       R = U − W S
    O   = scale [(Q ⊙ Γ) S + P R]
    S   ← Γ_C ⊙ S + (K̃ ⊙ Γ_C/Γ)ᵀ R                  (stored to final[doc] after a doc's last chunk)

Without decay or with a scalar decay L and P are formed here; with a per-channel decay they come
in precomputed (``A``, ``P``), since the ratio Γ_i/Γ_j cannot be factored without overflow.
Inputs use the document-aligned chunk layout of ``precond_linattn.varlen`` flattened to
[B, NC·C, H, D]; per-chunk flags ``doc``, ``first``, ``last`` are [B, NC] int32.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.triton_common import Dots, iota2, out_struct, unit_lower_inverse


def _kernel(*refs, chunk, decay, scale, dots, has_init, store_states, num_chunks):
    refs = list(refs)
    doc_ref, first_ref, last_ref, q_ref, k_ref, kw_ref, v_ref, beta_ref = refs[:8]
    del refs[:8]
    g_ref = refs.pop(0) if decay != "none" else None
    A_ref, P_ref = (refs.pop(0), refs.pop(0)) if decay == "vector" else (None, None)
    init_ref = refs.pop(0) if has_init else None
    o_ref, final_ref = refs[:2]
    states_ref = refs[2] if store_states else None

    C = chunk
    K, BV = q_ref.shape[-1], v_ref.shape[-1]
    f32 = jnp.float32
    i, j = iota2(C)

    def body(c, S):
        t0 = pl.multiple_of(c * C, C)
        rows = pl.ds(t0, C)
        doc, first, last = doc_ref[c], first_ref[c], last_ref[c]
        S0 = init_ref[doc] if has_init else jnp.zeros_like(S)
        S = jnp.where(first != 0, S0, S)
        if store_states:
            states_ref[c] = S
        q, k, kw = q_ref[rows, :], k_ref[rows, :], kw_ref[rows, :]
        beta = beta_ref[rows].astype(f32)[:, None]
        qf, kf, kwf = q.astype(f32), k.astype(f32), kw.astype(f32)
        if decay == "vector":
            g = g_ref[rows, :]
            g_last = g_ref[t0 + C - 1, :]
            qf, kf = qf * jnp.exp(g), kf * jnp.exp(g)
            kwf = kwf * jnp.exp(g_last[None, :] - g)
            gc = jnp.exp(g_last)[:, None]
            L, P = A_ref[rows, :], P_ref[rows, :]
        else:
            kk, qk = dots.nt(k, kw), dots.nt(q, kw)
            if decay == "scalar":
                g = g_ref[rows]
                g_last = g_ref[t0 + C - 1]
                D = jnp.exp(jnp.where(i >= j, g[:, None] - g[None, :], -jnp.inf))
                kk, qk = kk * D, qk * D
                qf, kf = qf * jnp.exp(g)[:, None], kf * jnp.exp(g)[:, None]
                kwf = kwf * jnp.exp(g_last - g)[:, None]
                gc = jnp.exp(g_last)
            L = jnp.where(i > j, beta * kk, 0.0)
            P = jnp.where(i >= j, qk, 0.0)
        T = unit_lower_inverse(L, dots)
        W = dots.nn(T, beta * kf)
        U = dots.nn(T, beta * v_ref[rows, :].astype(f32))
        R = U - dots.nn(W, S)
        o_ref[rows, :] = (scale * (dots.nn(qf, S) + dots.nn(P, R))).astype(o_ref.dtype)
        S = S + dots.tn(kwf, R) if decay == "none" else gc * S + dots.tn(kwf, R)

        @pl.when(last != 0)
        def _():
            final_ref[doc] = S

        return S

    lax.fori_loop(0, num_chunks, body, jnp.zeros((K, BV), f32))


def delta_fwd(q, k, kw, v, beta, gamma, A, P, initial_state, doc, first, last, *, chunk, decay,
              scale, num_docs, block_v, dots: Dots, num_warps, num_stages, store_states):
    """Run the kernel. Shapes: q, k, kw [B, Tp, H, K]; v [B, Tp, H, V]; beta [B, Tp, H];
    gamma None | [B, Tp, H] | [B, Tp, H, K] float32; A, P None | [B, H, Tp, C] float32;
    initial_state None | [N, H, K, V] float32; doc, first, last [B, NC] int32; ``num_docs``:
    N, or None for one document per batch row (N = B).

    Returns o [B, Tp, H, V] (v's dtype), final [N, H, K, V] float32 and, if ``store_states``,
    the state at the start of every chunk [B, H, NC, K, V] float32."""
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    num_docs = B if num_docs is None else num_docs
    nc = Tp // chunk
    BV = min(block_v, V)
    grid = (B, H, V // BV)
    row = lambda b, h, j: (b, 0)  # noqa: E731
    seq_k = pl.BlockSpec((None, Tp, None, K), lambda b, h, j: (b, 0, h, 0))
    seq_v = pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j))
    seq_1 = pl.BlockSpec((None, Tp, None), lambda b, h, j: (b, 0, h))
    per_chunk = pl.BlockSpec((None, None, Tp, chunk), lambda b, h, j: (b, h, 0, 0))
    state = pl.BlockSpec((num_docs, None, K, BV), lambda b, h, j: (0, h, 0, j))
    flags = pl.BlockSpec((None, nc), row)

    args = [doc, first, last, q, k, kw, v, beta]
    specs = [flags, flags, flags, seq_k, seq_k, seq_k, seq_v, seq_1]
    if decay != "none":
        args.append(gamma)
        specs.append(seq_k if decay == "vector" else seq_1)
    if decay == "vector":
        args += [A, P]
        specs += [per_chunk, per_chunk]
    if initial_state is not None:
        args.append(initial_state)
        specs.append(state)
    out_shape = [out_struct((B, Tp, H, V), v.dtype, *args),
                 out_struct((num_docs, H, K, V), jnp.float32, *args)]
    out_specs = [seq_v, state]
    if store_states:
        out_shape.append(out_struct((B, H, nc, K, V), jnp.float32, *args))
        out_specs.append(pl.BlockSpec((None, None, nc, K, BV), lambda b, h, j: (b, h, 0, 0, j)))
    kernel = functools.partial(_kernel, chunk=chunk, decay=decay, scale=scale, dots=dots,
                               has_init=initial_state is not None, store_states=store_states,
                               num_chunks=nc)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name=f"delta_fwd_{decay}",
    )(*args)
