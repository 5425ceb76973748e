"""Backward of the chunk recurrence of the delta core, Pallas Triton lowering.

Per chunk the forward is, with the per-chunk tensors of ``delta_rule.prepare`` (W, U, K̃' =
K̃ ⊙ Γ_C/Γ, Q' = Q ⊙ Γ, P, Γ_C) and S the state at the chunk start:

    R = U − W S        O = scale (Q' S + P R)        S_C = Γ_C ⊙ S + K̃'ᵀ R

One program per (batch row, head, V tile) walks the chunks backwards carrying dS_C (float32, in
registers) and emits, from dO and the states saved by the forward:

    dR  = scale Pᵀ dO + K̃' dS_C            dU = dR             dW = −dR Sᵀ
    dQ' = scale dO Sᵀ      dP = scale dO Rᵀ      dK̃' = R dS_Cᵀ      dΓ_C = rowsum(dS_C ⊙ S)
    dS  = Γ_C ⊙ dS_C + scale Q'ᵀ dO − Wᵀ dR

dS_C is the final state's cotangent after a document's last chunk; at a document's first chunk dS
is the initial state's cotangent and the carry restarts at 0. Outputs that sum over V (dW, dQ',
dP, dK̃', dΓ_C) are written per V tile and summed by the caller (no atomics: deterministic).
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.triton_common import Dots, out_struct


def _kernel(doc_ref, first_ref, last_ref, W_ref, U_ref, kw_ref, q_ref, P_ref, gc_ref, states_ref,
            do_ref, dfinal_ref, dW_ref, dU_ref, dkw_ref, dq_ref, dP_ref, dgc_ref, dinit_ref, *,
            chunk, scale, dots, num_chunks):
    C = chunk
    K, BV = W_ref.shape[-1], U_ref.shape[-1]

    def body(it, dS):
        c = num_chunks - 1 - it
        rows = pl.ds(pl.multiple_of(c * C, C), C)
        doc, first, last = doc_ref[c], first_ref[c], last_ref[c]
        dS = jnp.where(last != 0, dfinal_ref[doc], dS)
        S = states_ref[c]
        W, kw, q, P = W_ref[rows, :], kw_ref[rows, :], q_ref[rows, :], P_ref[rows, :]
        dO = do_ref[rows, :].astype(jnp.float32)
        R = U_ref[rows, :] - dots.nn(W, S)
        dR = scale * dots.tn(P, dO) + dots.nn(kw, dS)
        dU_ref[rows, :] = dR
        dW_ref[rows, :] = -dots.nt(dR, S)
        dq_ref[rows, :] = scale * dots.nt(dO, S)
        dP_ref[rows, :] = scale * dots.nt(dO, R)
        dkw_ref[rows, :] = dots.nt(R, dS)
        dgc_ref[c, :] = jnp.sum(dS * S, axis=1)
        dS0 = gc_ref[c, :][:, None] * dS + scale * dots.tn(q, dO) - dots.tn(W, dR)

        @pl.when(first != 0)
        def _():
            dinit_ref[doc] = dS0

        return jnp.where(first != 0, 0.0, dS0)

    lax.fori_loop(0, num_chunks, body, jnp.zeros((K, BV), jnp.float32))


def delta_bwd(W, U, kw, q, P, gc, states, do, dfinal, doc, first, last, *, chunk, scale,
              block_v, dots: Dots, num_warps, num_stages):
    """Shapes: W, kw, q [B, H, Tp, K]; U [B, H, Tp, V]; P [B, H, Tp, C]; gc [B, H, NC, K];
    states [B, H, NC, K, V]; do [B, Tp, H, V]; dfinal [N, H, K, V]; doc, first, last [B, NC].

    Returns dW, dK̃', dQ' [NT, B, H, Tp, K], dU [B, H, Tp, V], dP [NT, B, H, Tp, C],
    dΓ_C [NT, B, H, NC, K] (NT = number of V tiles, to be summed) and dS_0 [N, H, K, V]."""
    B, H, Tp, K = W.shape
    V, N, nc = U.shape[-1], dfinal.shape[0], Tp // chunk
    BV = min(block_v, V)
    nt = V // BV
    grid = (B, H, nt)
    f32 = jnp.float32
    flags = pl.BlockSpec((None, nc), lambda b, h, j: (b, 0))
    seq_k = pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (b, h, 0, 0))
    seq_v = pl.BlockSpec((None, None, Tp, BV), lambda b, h, j: (b, h, 0, j))
    seq_c = pl.BlockSpec((None, None, Tp, chunk), lambda b, h, j: (b, h, 0, 0))
    per_chunk_k = pl.BlockSpec((None, None, nc, K), lambda b, h, j: (b, h, 0, 0))
    states_spec = pl.BlockSpec((None, None, nc, K, BV), lambda b, h, j: (b, h, 0, 0, j))
    do_spec = pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j))
    state = pl.BlockSpec((N, None, K, BV), lambda b, h, j: (0, h, 0, j))
    part = lambda *blk: pl.BlockSpec((None, None, None, *blk),  # noqa: E731
                                     lambda b, h, j: (j, b, h, 0, 0))
    args = [doc, first, last, W, U, kw, q, P, gc, states, do, dfinal]
    out_shape = [out_struct(shape, f32, *args) for shape in (
        (nt, B, H, Tp, K), (B, H, Tp, V), (nt, B, H, Tp, K), (nt, B, H, Tp, K),
        (nt, B, H, Tp, chunk), (nt, B, H, nc, K), (N, H, K, V))]
    out_specs = [part(Tp, K), seq_v, part(Tp, K), part(Tp, K), part(Tp, chunk), part(nc, K), state]
    kernel = functools.partial(_kernel, chunk=chunk, scale=scale, dots=dots, num_chunks=nc)
    return pl.pallas_call(
        kernel, grid=grid,
        in_specs=[flags, flags, flags, seq_k, seq_v, seq_k, seq_k, seq_c, per_chunk_k,
                  states_spec, do_spec, state],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name="delta_bwd",
    )(*args)
