"""Split backward of the chunk recurrence of the delta core, Pallas Triton lowering.

The same math as ``delta_bwd_triton`` (see its docstring), with S the chunk-start state, dS_C
the cotangent of the chunk-end state and R = U − W S, in three kernels:

1. parallel over (batch row, head, chunk, V tile), the products of dO that the carry needs:
       A = scale Pᵀ dO   [C, BV]         G = scale Q'ᵀ dO   [K, BV]
2. serial, one program per (batch row, head, V tile), chunks in reverse, dS_C float32 in
   registers (2 matmuls per chunk on the serial path):
       dS_C ← dfinal[doc] after a doc's last chunk;  store dS_C
       dR = A + K̃' dS_C   (= dU, stored)        dS = Γ_C ⊙ dS_C + G − Wᵀ dR
       dinit[doc] = dS at a doc's first chunk, where the carry restarts at 0
3. parallel over (batch row, head, chunk, tile of key rows), summing over V tiles in registers
   (R is the forward's; key tiles keep the accumulators small):
       dW = −dR Sᵀ    dQ' = scale dO Sᵀ    dP = scale dO Rᵀ    dK̃' = R dS_Cᵀ    dΓ_C = rowsum(dS_C ⊙ S)

No atomics: every output element is written by one program (deterministic).
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import sequence_split, state_mosaic
from pallas_kernels.state_fwd_triton import check_inputs, chunk_specs, serial_specs
from pallas_kernels.triton_common import Dots, out_struct


def dout_a(P, do, scale, dots):
    """A = scale Pᵀ dO of one chunk (float32)."""
    return scale * dots.tn(P, do.astype(jnp.float32))


def dout_g(q, do, scale, dots, transposed=False):
    """G = scale Q'ᵀ dO of one chunk (float32; ``transposed``: Gᵀ)."""
    dO = do.astype(jnp.float32)
    return scale * (dots.tn(dO, q) if transposed else dots.tn(q, dO))


def _dout_kernel(*refs, scale, dots, transposed, with_G):
    """A = scale Pᵀ dO and (``with_G``) G = scale Q'ᵀ dO for one chunk and V tile."""
    if with_G:
        P_ref, q_ref, do_ref, A_ref, G_ref = refs
        G_ref[...] = dout_g(q_ref[...], do_ref[...], scale, dots, transposed).astype(G_ref.dtype)
    else:
        P_ref, do_ref, A_ref = refs
    A_ref[...] = dout_a(P_ref[...], do_ref[...], scale, dots).astype(A_ref.dtype)


def _serial_kernel(doc_ref, first_ref, last_ref, W_ref, kw_ref, gc_ref, *refs, chunk, dots,
                   num_chunks, products):
    """The reverse recurrence dS_C → Γ_C ⊙ dS_C + G − Wᵀ (A + K̃' dS_C), storing dR and dS_C.
    A, G are read (refs A, G), or with ``products`` = (scale, their dots) formed here from P,
    Q', dO (refs P, q, do) as ``dout_products`` does, off the carry's path."""
    n_in = 3 if products else 2
    ins, (dfinal_ref, dU_ref, dstates_ref, dinit_ref) = refs[:n_in], refs[n_in:]
    K, BV = W_ref.shape[-1], dU_ref.shape[-1]

    def dout(c, rows):
        """(A, G) of chunk c, float32."""
        if not products:
            A_ref, G_ref = ins
            return A_ref[rows, :].astype(jnp.float32), G_ref[c].astype(jnp.float32)
        (scale, pdots), (P_ref, q_ref, do_ref) = products, ins
        do = do_ref[rows, :]
        return dout_a(P_ref[rows, :], do, scale, pdots), dout_g(q_ref[rows, :], do, scale, pdots)

    def body(it, dS):
        c = num_chunks - 1 - it
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        doc, first, last = doc_ref[c], first_ref[c], last_ref[c]
        A, G = dout(c, rows)
        dS = jnp.where(last != 0, dfinal_ref[doc], dS)
        dstates_ref[c] = dS.astype(dstates_ref.dtype)
        dR = A + dots.nn(kw_ref[rows, :], dS)
        dU_ref[rows, :] = dR.astype(dU_ref.dtype)
        dS0 = gc_ref[c, :][:, None] * dS + G - dots.tn(W_ref[rows, :], dR)

        @pl.when(first != 0)
        def _():
            dinit_ref[doc] = dS0

        return jnp.where(first != 0, 0.0, dS0)

    lax.fori_loop(0, num_chunks, body, jnp.zeros((K, BV), jnp.float32))


def _grads_kernel(S_ref, dS_ref, dR_ref, R_ref, do_ref, dW_ref, dkw_ref, dq_ref, dP_ref, dgc_ref,
                  *, scale, dots, block_v, transposed):
    """One chunk and one tile κ of key rows, summed over the V tiles of block_v columns:
    dW[:, κ] = −dR S[κ]ᵀ, dK̃'[:, κ] = R dS[κ]ᵀ, dQ'[:, κ] = scale dO S[κ]ᵀ, dΓ_C[κ] =
    rowsum(dS[κ] ⊙ S[κ]); the program of tile 0 also writes dP = scale dO Rᵀ. ``transposed``:
    S and dS given as Sᵀ, dSᵀ."""
    C, BK = dW_ref.shape
    by_s = dots.nn if transposed else dots.nt  # x S[κ]ᵀ

    def tile(j, acc):
        dW, dkw, dq, dP, dgc = acc
        cols = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
        S, dS = (S_ref[cols, :], dS_ref[cols, :]) if transposed else (S_ref[:, cols],
                                                                      dS_ref[:, cols])
        dR, R = dR_ref[:, cols], R_ref[:, cols]
        dO = do_ref[:, cols].astype(jnp.float32)
        return (dW - by_s(dR, S), dkw + by_s(R, dS), dq + scale * by_s(dO, S),
                dP + scale * dots.nt(dO, R),
                dgc + jnp.sum(dS.astype(jnp.float32) * S.astype(jnp.float32),
                              axis=0 if transposed else 1))

    f32 = jnp.float32
    zeros = (jnp.zeros((C, BK), f32),) * 3 + (jnp.zeros((C, C), f32), jnp.zeros((BK,), f32))
    dW, dkw, dq, dP, dgc = lax.fori_loop(0, dR_ref.shape[-1] // block_v, tile, zeros)
    dW_ref[...], dkw_ref[...], dq_ref[...], dgc_ref[...] = dW, dkw, dq, dgc

    @pl.when(pl.program_id(3) == 0)
    def _():
        dP_ref[...] = dP


def dout_products(P, q, do, *, chunk, scale, block_v, dots: Dots, num_warps, num_stages,
                  state_dtype=jnp.float32, transposed=False, with_G=True):
    """Kernel 1: A = scale Pᵀ dO [B, H, Tp, V] and (``with_G``) G = scale Q'ᵀ dO
    [B, H, NC, K, V] per chunk (``transposed``: Gᵀ [B, H, NC, V, K]), stored in
    ``state_dtype``; a list. Without G, q is not read (None allowed)."""
    B, H, Tp, _ = P.shape
    V, nc, BV = do.shape[-1], Tp // chunk, min(block_v, do.shape[-1])
    K = q.shape[-1] if with_G else 16  # no q tile without G
    c = chunk_specs(chunk, K, BV, transposed)
    shapes = [(B, H, Tp, V)] + [(B, H, nc, V, K) if transposed else (B, H, nc, K, V)] * with_G
    ins, specs = ([P, q, do], [c["c"], c["k"], c["btv"]]) if with_G else (
        [P, do], [c["c"], c["btv"]])
    return pl.pallas_call(
        functools.partial(_dout_kernel, scale=scale, dots=dots, transposed=transposed,
                          with_G=with_G),
        grid=(B, H, nc, V // BV), in_specs=specs, out_specs=[c["v"], c["state"]][:len(shapes)],
        out_shape=[out_struct(shape, state_dtype, *ins) for shape in shapes],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name="dout_products",
    )(*ins)


def state_pass(W, kw, gc, A, G, dfinal, doc, first, last, *, chunk, block_v, dots: Dots,
               num_warps, num_stages, state_dtype=jnp.float32, products=None):
    """Kernel 2, serial: dU = dR [B, H, Tp, V] and the chunk-end cotangents dS_C
    [B, H, NC, K, V] stored in ``state_dtype`` (the carry stays float32), dS_0 [N, H, K, V]
    float32. A, G: kernel 1's products; or None with ``products`` = (P, q, do, scale, dots): the
    pass forms them itself (no kernel 1)."""
    B, H, Tp, K = W.shape
    V, N, nc = dfinal.shape[-1], dfinal.shape[0], Tp // chunk
    BV, f32 = min(block_v, V), jnp.float32
    s = serial_specs(nc, Tp, K, BV, N)
    if products is None:
        ins, in_specs, static = [A, G], [s["seq_v"], s["states"]], None
    else:
        P, q, do, scale, pdots = products
        ins, in_specs, static = [P, q, do], [s["seq_c"], s["seq_k"], s["btv"]], (scale, pdots)
    args = [doc, first, last, W, kw, gc, *ins, dfinal]
    return pl.pallas_call(
        functools.partial(_serial_kernel, chunk=chunk, dots=dots, num_chunks=nc,
                          products=static),
        grid=(B, H, V // BV),
        in_specs=[s["flags"]] * 3 + [s["seq_k"], s["seq_k"], s["per_chunk_k"], *in_specs,
                                     s["docs"]],
        out_specs=[s["seq_v"], s["states"], s["docs"]],
        out_shape=[out_struct(shape, dtype, *args)
                   for shape, dtype in (((B, H, Tp, V), state_dtype),
                                        ((B, H, nc, K, V), state_dtype), ((N, H, K, V), f32))],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name="state_bwd",
    )(*args)


def chunk_grads(states, dstates, dU, R, do, *, chunk, scale, block_v, dots: Dots, num_warps,
                num_stages, block_k=64, transposed=False):
    """Kernel 3, parallel over (row, head, chunk, tile of ``block_k`` key rows): dW, dK̃', dQ'
    [B, H, Tp, K], dP [B, H, Tp, C], dΓ_C [B, H, NC, K] from the chunk-start states, the
    chunk-end cotangents (both [B, H, NC, K, V], ``transposed``: [B, H, NC, V, K]), dR (= dU)
    and R = U − W S [B, H, Tp, V] (kept by the forward)."""
    B, H, nc = states.shape[:3]
    K, V = states.shape[3:][::-1] if transposed else states.shape[3:]
    Tp, BV, BK, f32 = nc * chunk, min(block_v, V), min(block_k, K), jnp.float32
    rows = lambda n, kt=False: pl.BlockSpec(  # noqa: E731
        (None, None, chunk, n), lambda b, h, i, t: (b, h, i, t if kt else 0))
    state = (pl.BlockSpec((None, None, None, V, BK), lambda b, h, i, t: (b, h, i, 0, t))
             if transposed else
             pl.BlockSpec((None, None, None, BK, V), lambda b, h, i, t: (b, h, i, t, 0)))
    return pl.pallas_call(
        functools.partial(_grads_kernel, scale=scale, dots=dots, block_v=BV,
                          transposed=transposed),
        grid=(B, H, nc, K // BK),
        in_specs=[state, state, rows(V), rows(V),
                  pl.BlockSpec((None, chunk, None, V), lambda b, h, i, t: (b, i, h, 0))],
        out_specs=[rows(BK, True)] * 3 + [
            rows(chunk), pl.BlockSpec((None, None, None, BK), lambda b, h, i, t: (b, h, i, t))],
        out_shape=[out_struct(shape, f32, states, dstates, dU, R, do) for shape in (
            (B, H, Tp, K), (B, H, Tp, K), (B, H, Tp, K), (B, H, Tp, chunk), (B, H, nc, K))],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name="chunk_grads",
    )(states, dstates, dU, R, do)


def split_backward(W, U, kw, q, P, gc, states, R, do, dfinal, doc, first, last, *, chunk, scale,
                   block_v, dots: Dots, num_warps, num_stages, block_k=64,
                   pdots: Dots | None = None, serial_block_v: int | None = None,
                   state_dtype=jnp.float32, dout_in_serial: bool = False,
                   serial_backend: str = "triton", pieces: int = 1, with_grads: bool = True):
    """``delta_bwd`` in three kernels; arguments and results as ``delta_bwd``, plus R = U − W S
    from the forward: W, kw (K̃'), q (Q') [B, H, Tp, K]; U, R [B, H, Tp, V]; P [B, H, Tp, C];
    gc (Γ_C) [B, H, NC, K]; states (chunk-start) [B, H, NC, K, V]; do [B, Tp, H, V]; dfinal
    [N, H, K, V]; doc, first, last [B, NC]; ``block_k``: key rows per program of kernel 3;
    ``pdots``: the dots of kernels 1 and 3 (default ``dots``; the serial kernel 2 uses ``dots``);
    ``serial_block_v``: kernel 2's V tile (default ``block_v``); ``state_dtype``: that of the
    tensors kernels 1 and 2 store (A, G, dU, dS_C); ``dout_in_serial``: kernel 2 forms A and G
    itself (no kernel 1; the Mosaic kernel 2 forms G, kernel 1 still A); ``serial_backend``:
    "mosaic" runs kernel 2 as ``state_mosaic.state_bwd`` (``states`` then transposed, as its
    forward stores them); ``pieces``: that pass over the sequence cut into pieces run in parallel
    (``sequence_split``; dense rows); ``with_grads`` False: no kernel 3, the result is (dU, dS_C,
    dS_0) (``grads_mosaic`` takes it from there).

    Returns dW, dK̃', dQ' [1, B, H, Tp, K], dU [B, H, Tp, V], dP [1, B, H, Tp, C], dΓ_C
    [1, B, H, NC, K] (already summed over V: the leading axis of ``delta_bwd``'s per-tile partial
    sums has size 1) and dS_0 [N, H, K, V]."""
    check_inputs(W, U, P, chunk=chunk, block_v=block_v, serial_block_v=serial_block_v)
    opts = dict(chunk=chunk, block_v=block_v, dots=dots, num_warps=num_warps,
                num_stages=num_stages)
    parallel = opts | dict(dots=pdots or dots)
    mosaic = serial_backend == "mosaic"
    if mosaic:  # A from kernel 1; G from it too, or formed in the pass (dout_in_serial)
        A, *G = dout_products(P, q, do, scale=scale, state_dtype=state_dtype, transposed=True,
                              with_G=not dout_in_serial, **parallel)
        serial_pass = functools.partial(state_mosaic.state_bwd, interpret=dots.interpret)
        if pieces > 1:
            serial_pass = sequence_split.backward(serial_pass, pieces)
        dU, dstates, dinit = serial_pass(
            W, kw, gc, A, G[0] if G else None, dfinal, doc, first, last,
            products=(q, do.astype(q.dtype), scale) if dout_in_serial else None)
    else:
        A = G = products = None
        if dout_in_serial:
            products = (P, q, do, scale, pdots or dots)
        else:
            A, G = dout_products(P, q, do, scale=scale, state_dtype=state_dtype, **parallel)
        dU, dstates, dinit = state_pass(W, kw, gc, A, G, dfinal, doc, first, last,
                                        state_dtype=state_dtype, products=products,
                                        **(opts | dict(block_v=serial_block_v or block_v)))
    if not with_grads:
        return dU, dstates, dinit
    grads = chunk_grads(states, dstates, dU, R, do, scale=scale, block_k=block_k,
                        transposed=mosaic, **parallel)
    dW, dkw, dq, dP, dgc = (x[None] for x in grads)
    return dW, dU, dkw, dq, dP, dgc, dinit
