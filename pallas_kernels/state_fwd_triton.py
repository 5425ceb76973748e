"""Split forward of the chunked delta core (SPEC 2.1), Pallas Triton lowering.

Takes the per-chunk WY tensors of ``delta_rule.prepare`` (W, U, K̃' = K̃ ⊙ Γ_C/Γ, Q' = Q ⊙ Γ,
P, Γ_C) instead of the raw inputs, and splits the fused ``delta_fwd`` in two kernels:

1. serial, one program per (batch row, head, V tile), walking the chunks in order with the
   float32 state S [K, BV] in registers (2 matmuls per chunk on the serial path):

       S ← initial[doc] (or 0) if the chunk starts a document;   store S (the chunk-start state)
       R = U − W S   (stored)          S ← Γ_C ⊙ S + K̃'ᵀ R   (→ final[doc] after a doc's last chunk)

2. parallel over (batch row, head, chunk, V tile):   O = scale (Q' S + P R).

Inputs use the document-aligned chunk layout of ``precond_linattn.varlen`` ([B, H, NC·C, ·]);
per-chunk flags ``doc``, ``first``, ``last`` are [B, NC] int32, as for ``delta_fwd``.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import sequence_split, state_mosaic
from pallas_kernels.triton_common import Dots, out_struct


def check_inputs(W, U, P, *, chunk, block_v, serial_block_v=None):
    """The V tile width min(block_v, V); ValueError naming the argument unless the chunk, the head
    dims and the tiles (``serial_block_v``: the serial passes' own, if given) are powers of two
    >= 16, P is [.., Tp, chunk] and chunk divides Tp."""
    V = U.shape[-1]
    BV = min(block_v, V)
    tiles = [("block_v", BV)] + ([("serial_block_v", min(serial_block_v, V))]
                                 if serial_block_v else [])
    for name, n in (("chunk", chunk), ("W (head dim K)", W.shape[-1]), ("U (head dim V)", V),
                    *tiles):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {n}")
    if P.shape[-1] != chunk or W.shape[-2] % chunk:
        raise ValueError(f"P must be [B, H, Tp, chunk] with chunk ({chunk}) dividing Tp, got "
                         f"P {P.shape}, W {W.shape}")
    return BV


def chunk_specs(chunk, K, BV, transposed=False):
    """BlockSpecs of one chunk's tiles for a grid (b, h, c, j) (j: V tile): rows [C, K], [C, C],
    [C, BV] of [B, H, Tp, ·] tensors, the state tile [K, BV] of [B, H, NC, K, V] (``transposed``:
    [BV, K] of [B, H, NC, V, K]) and the rows [C, BV] of [B, Tp, H, V] (o, dO)."""
    state = (pl.BlockSpec((None, None, None, BV, K), lambda b, h, c, j: (b, h, c, j, 0))
             if transposed else
             pl.BlockSpec((None, None, None, K, BV), lambda b, h, c, j: (b, h, c, 0, j)))
    return dict(
        k=pl.BlockSpec((None, None, chunk, K), lambda b, h, c, j: (b, h, c, 0)),
        c=pl.BlockSpec((None, None, chunk, chunk), lambda b, h, c, j: (b, h, c, 0)),
        v=pl.BlockSpec((None, None, chunk, BV), lambda b, h, c, j: (b, h, c, j)),
        state=state,
        btv=pl.BlockSpec((None, chunk, None, BV), lambda b, h, c, j: (b, c, h, j)))


def serial_specs(nc, Tp, K, BV, N):
    """BlockSpecs for a serial grid (b, h, j): flags [NC], whole sequences [Tp, K] / [Tp, BV] /
    [Tp, C] of [B, H, Tp, ·] tensors and [Tp, BV] of [B, Tp, H, V] ones (o, dO), per-chunk rows
    [NC, K], all chunk states [NC, K, BV] and document states [N, K, BV]."""
    return dict(
        flags=pl.BlockSpec((None, nc), lambda b, h, j: (b, 0)),
        seq_k=pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (b, h, 0, 0)),
        seq_v=pl.BlockSpec((None, None, Tp, BV), lambda b, h, j: (b, h, 0, j)),
        per_chunk_k=pl.BlockSpec((None, None, nc, K), lambda b, h, j: (b, h, 0, 0)),
        states=pl.BlockSpec((None, None, nc, K, BV), lambda b, h, j: (b, h, 0, 0, j)),
        docs=pl.BlockSpec((N, None, K, BV), lambda b, h, j: (0, h, 0, j)),
        seq_c=pl.BlockSpec((None, None, Tp, Tp // nc), lambda b, h, j: (b, h, 0, 0)),
        btv=pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j)))


def outputs(q, P, S, R, scale, dots, transposed=False):
    """O = scale (Q' S + P R) of one chunk (float32); ``transposed``: S given as Sᵀ."""
    return scale * ((dots.nt if transposed else dots.nn)(q, S) + dots.nn(P, R))


def _serial_kernel(*refs, chunk, dots, has_init, num_chunks, store, output):
    """The chunk recurrence S → Γ_C ⊙ S + K̃'ᵀ (U − W S), storing (``store``) S and R = U − W S
    per chunk; with ``output`` = (scale, output dots) also O = scale (Q' S + P R) per chunk, off
    the carry's path."""
    refs = list(refs)
    doc_ref, first_ref, last_ref, W_ref, U_ref, kw_ref, gc_ref = refs[:7]
    init_ref = refs[7] if has_init else None
    q_ref, P_ref = refs[7 + has_init:9 + has_init] if output else (None, None)
    outs = refs[7 + has_init + 2 * bool(output):]
    states_ref, R_ref = outs[:2] if store else (None, None)
    final_ref = outs[2 * store]
    o_ref = outs[-1] if output else None
    K, BV = W_ref.shape[-1], U_ref.shape[-1]

    def body(c, S):
        rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        doc, first, last = doc_ref[c], first_ref[c], last_ref[c]
        S = jnp.where(first != 0, init_ref[doc] if has_init else 0.0, S)
        R = U_ref[rows, :] - dots.nn(W_ref[rows, :], S)
        if store:
            states_ref[c] = S.astype(states_ref.dtype)
            R_ref[rows, :] = R.astype(R_ref.dtype)
        if output:
            scale, odots = output
            o_ref[rows, :] = outputs(q_ref[rows, :], P_ref[rows, :], S, R, scale,
                                     odots).astype(o_ref.dtype)
        S = gc_ref[c, :][:, None] * S + dots.tn(kw_ref[rows, :], R)

        @pl.when(last != 0)
        def _():
            final_ref[doc] = S

        return S

    lax.fori_loop(0, num_chunks, body, jnp.zeros((K, BV), jnp.float32))


def _output_kernel(q_ref, P_ref, S_ref, R_ref, o_ref, *, scale, dots, transposed):
    """O = scale (Q' S + P R) for one chunk and V tile."""
    o_ref[...] = outputs(q_ref[...], P_ref[...], S_ref[...], R_ref[...], scale, dots,
                         transposed).astype(o_ref.dtype)


def state_pass(W, U, kw, gc, initial_state, doc, first, last, *, chunk, num_docs, block_v,
               dots: Dots, num_warps, num_stages, state_dtype=jnp.float32, store=True,
               output=None):
    """Kernel 1, serial: if ``store``, the chunk-start states [B, H, NC, K, V] and R = U − W S
    [B, H, Tp, V] stored in ``state_dtype`` (the carry stays float32); the final states
    [N, H, K, V] float32; with ``output`` = (q, P, scale, dots, dtype) also
    o = scale (Q' S + P R) [B, Tp, H, V] (``chunk_output`` inside the pass). Returns that list."""
    B, H, Tp, K = W.shape
    V, nc, f32 = U.shape[-1], Tp // chunk, jnp.float32
    BV, N = min(block_v, V), B if num_docs is None else num_docs
    s = serial_specs(nc, Tp, K, BV, N)
    args = [doc, first, last, W, U, kw, gc]
    specs = [s["flags"]] * 3 + [s["seq_k"], s["seq_v"], s["seq_k"], s["per_chunk_k"]]
    if initial_state is not None:
        args.append(initial_state)
        specs.append(s["docs"])
    out_specs, shapes = [s["docs"]], [((N, H, K, V), f32)]
    if store:
        out_specs[:0] = [s["states"], s["seq_v"]]
        shapes[:0] = [((B, H, nc, K, V), state_dtype), ((B, H, Tp, V), state_dtype)]
    if output is not None:
        q, P, scale, odots, out_dtype = output
        args += [q, P]
        specs += [s["seq_k"], s["seq_c"]]
        out_specs.append(s["btv"])
        shapes.append(((B, Tp, H, V), out_dtype))
        output = (scale, odots)
    return pl.pallas_call(
        functools.partial(_serial_kernel, chunk=chunk, dots=dots,
                          has_init=initial_state is not None, num_chunks=nc, store=store,
                          output=output),
        grid=(B, H, V // BV), in_specs=specs, out_specs=out_specs,
        out_shape=[out_struct(shape, dtype, *args) for shape, dtype in shapes],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name="state_fwd",
    )(*args)


def chunk_output(q, P, states, R, *, chunk, scale, block_v, dots: Dots, num_warps, num_stages,
                 out_dtype, transposed=False):
    """Kernel 2, parallel over chunks: o = scale (Q' S + P R) [B, Tp, H, V] in ``out_dtype``
    (``transposed``: states given as [B, H, NC, V, K])."""
    B, H, Tp, K = q.shape
    V = R.shape[-1]
    BV = min(block_v, V)
    c = chunk_specs(chunk, K, BV, transposed)
    return pl.pallas_call(
        functools.partial(_output_kernel, scale=scale, dots=dots, transposed=transposed),
        grid=(B, H, Tp // chunk, V // BV), in_specs=[c["k"], c["c"], c["state"], c["v"]],
        out_specs=c["btv"], out_shape=out_struct((B, Tp, H, V), out_dtype, q, P, states, R),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=dots.interpret, name="chunk_output",
    )(q, P, states, R)


def split_forward(W, U, kw, q, P, gc, initial_state, doc, first, last, *, chunk, scale, num_docs,
                  block_v, dots: Dots, num_warps, num_stages, store_states,
                  out_dtype=jnp.float32, pdots: Dots | None = None,
                  serial_block_v: int | None = None, state_dtype=jnp.float32,
                  output_in_serial: bool = False, serial_backend: str = "triton",
                  pieces: int = 1):
    """``delta_fwd`` from the WY tensors. Shapes: W, kw (K̃'), q (Q') [B, H, Tp, K]; U [B, H, Tp, V];
    P [B, H, Tp, C]; gc (Γ_C) [B, H, NC, K]; initial_state None | [N, H, K, V] float32; doc,
    first, last [B, NC] int32; ``num_docs``: N, or None for one document per batch row (N = B).

    Returns o [B, Tp, H, V] (``out_dtype``), final [N, H, K, V] float32 and, if ``store_states``,
    what the backward reads: the state at the start of every chunk [B, H, NC, K, V] and R = U − W S
    [B, H, Tp, V], float32 (always computed: the output kernel reads them). ``pdots``: the
    output kernel's dots (default ``dots``; the state pass always uses ``dots``);
    ``serial_block_v``: the state pass's V tile (default ``block_v``; narrower tiles give the
    serial pass more programs); ``state_dtype``: that of the stored states and R (bfloat16 halves
    their traffic; the kernels that read them round them to bf16 at their dots anyway when
    ``pdots`` is "bf16"); ``output_in_serial``: form o inside the state pass (no output kernel;
    without ``store_states`` the states and R are then never written); ``serial_backend``:
    "mosaic" runs the state pass as ``state_mosaic.state_fwd`` (bf16 tensors; the saved states
    are then transposed, [B, H, NC, V, K]); ``pieces``: the Mosaic pass over the sequence cut
    into that many pieces run in parallel (``sequence_split``; dense rows)."""
    check_inputs(W, U, P, chunk=chunk, block_v=block_v, serial_block_v=serial_block_v)
    opts = dict(chunk=chunk, block_v=block_v, dots=dots, num_warps=num_warps,
                num_stages=num_stages)
    serial = dict(num_docs=num_docs, state_dtype=state_dtype,
                  **(opts | dict(block_v=serial_block_v or block_v)))
    mosaic = serial_backend == "mosaic"
    if mosaic:
        serial_pass = functools.partial(state_mosaic.state_fwd, num_docs=num_docs,
                                        interpret=dots.interpret)
        if pieces > 1:
            serial_pass = sequence_split.forward(serial_pass, pieces)
        output = (q, P, scale, out_dtype)
    else:
        serial_pass = functools.partial(state_pass, **serial)
        output = (q, P, scale, pdots or dots, out_dtype)
    if output_in_serial:
        *saved, final, o = serial_pass(W, U, kw, gc, initial_state, doc, first, last,
                                       store=store_states, output=output)
        return (o, final, *saved)
    states, R, final = serial_pass(W, U, kw, gc, initial_state, doc, first, last)
    o = chunk_output(q, P, states, R, scale=scale, out_dtype=out_dtype, transposed=mosaic,
                     **(opts | dict(dots=pdots or dots)))
    return (o, final) + ((states, R) if store_states else ())
