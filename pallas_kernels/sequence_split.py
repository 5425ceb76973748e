"""Serial state passes over a sequence cut into pieces that run in parallel (dense rows).

With few rows and heads (B = 1 at a long T, or a prefill) a serial pass has B H V / 64 programs
for T / C dependent chunk steps and leaves most of the GPU idle. A chunk step is affine in the
state it carries, S_{c+1} = (Γ_C − K̃'ᵀ W) S_c + K̃'ᵀ U, so each piece of NC / p chunks maps its
entry state affinely, S_out = Φ S_in + F, and the pieces' Φ and F come from one pass with every
piece started at once:

    pass A   the values [U | 0] (V + K columns) from the initial state [0 | I]: its final states
             are [F | Φ] (Φ is the pass applied to the identity; the V columns carry U from 0)
    chain    S_in(0) = the row's initial state,  S_in(i + 1) = Φ_i S_in(i) + F_i  (p small
             matrix products in XLA, float32)
    pass B   the pass itself, every piece from its S_in: the states, R, outputs and final state
             the unsplit pass gives, up to the rounding of the chain

The backward pass is the same with the roles reversed: pass A from dS = [0 | I] at every piece's
end with [A | 0] (or [dO | 0] when the pass forms its dO products) gives each piece's dS_0 from
its own cotangents and its map Ψ (= Φᵀ); the chain runs from the last piece down,
dfinal(i − 1) = Ψ_i dfinal(i) + dS_0^own(i); pass B then gives dU, dS_C and dS_0.

Pieces ride along the head axis: [B, H, Tp, ·] -> [B, H p, Tp / p, ·] is a reshape (head h,
piece i -> head h p + i), and so are the per-chunk tensors; only [B, Tp, H, V] tensors (outputs,
dO) are transposed. Each piece is one document of its row (flags first / last at its ends).
Dense rows only (one document per row): the op does not split packed documents.
"""

import jax.numpy as jnp
from jax import lax

SMS = 132  # streaming multiprocessors of an H100 / H200
MIN_CHUNKS = 8  # chunks a piece keeps at least (the chain and pass A must pay for themselves)


def auto_pieces(*, programs: int, chunks: int) -> int:
    """The pieces a pass of ``programs`` CTAs over ``chunks`` chunks is cut into: the largest
    power of two p with programs p <= SMS and chunks / p >= MIN_CHUNKS dividing ``chunks``
    (1 when the pass already has half the GPU's SMs)."""
    p = 1
    while 2 * programs * p <= SMS and chunks % (2 * p) == 0 and chunks // (2 * p) >= MIN_CHUNKS:
        p *= 2
    return p


def _pieces(x, p):
    """[B, H, n, ...] -> [B, H p, n / p, ...] (head h, piece i -> head h p + i)."""
    B, H, n = x.shape[:3]
    return x.reshape(B, H * p, n // p, *x.shape[3:])


def _whole(x, p):
    """``_pieces``' inverse."""
    B, Hp, n = x.shape[:3]
    return x.reshape(B, Hp // p, n * p, *x.shape[3:])


def _pieces_bthv(x, p):
    """[B, Tp, H, V] -> [B, Tp / p, H p, V]."""
    B, Tp, H, V = x.shape
    return x.reshape(B, p, Tp // p, H, V).transpose(0, 2, 3, 1, 4).reshape(B, Tp // p, H * p, V)


def _whole_bthv(x, p):
    """``_pieces_bthv``' inverse."""
    B, n, Hp, V = x.shape
    return x.reshape(B, n, Hp // p, p, V).transpose(0, 3, 1, 2, 4).reshape(B, n * p, Hp // p, V)


def _flags(doc, p):
    """doc, first, last [B, NC / p]: every piece one document of its row (dense rows: ``doc``
    constant along a row)."""
    n = doc.shape[1] // p
    at = jnp.arange(n)
    first = jnp.broadcast_to((at == 0).astype(jnp.int32), (doc.shape[0], n))
    return doc[:, :n], first, jnp.broadcast_to((at == n - 1).astype(jnp.int32), first.shape)


def _augmented(values, K):
    """[values | 0]: K zero columns after the last axis."""
    return jnp.concatenate([values, jnp.zeros(values.shape[:-1] + (K,), values.dtype)], -1)


def _identity_start(B, Hp, K, V):
    """[0 | I] [B, Hp, K, V + K] float32: pass A's state at every piece's start (or end)."""
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, Hp, K, K))
    return jnp.concatenate([jnp.zeros((B, Hp, K, V), jnp.float32), eye], -1)


def _chain(maps, own, start, p, reverse):
    """Entry states (exit cotangents if ``reverse``) of the p pieces: x(0) = start, x(i + 1) =
    maps_i x(i) + own_i (from the last piece down if ``reverse``). maps [B, H p, K, K], own
    [B, H p, K, V], start [B, H, K, V] -> [B, H p, K, V]."""
    B, Hp, K, V = own.shape
    split = lambda x: jnp.moveaxis(x.reshape(B, Hp // p, p, *x.shape[2:]), 2, 0)  # noqa: E731

    def step(x, piece):
        m, f = piece
        return jnp.einsum("bhkl,bhlv->bhkv", m, x, precision="highest") + f, x

    _, xs = lax.scan(step, start, (split(maps), split(own)), reverse=reverse)
    return jnp.moveaxis(xs, 0, 2).reshape(B, Hp, K, V)


def forward(serial_pass, p):
    """``serial_pass`` (``state_mosaic.state_fwd`` with its static arguments bound) over p pieces
    in parallel: the same signature and results (module docstring)."""
    def run(W, U, kw, gc, initial_state, doc, first, last, *, store=True, output=None):
        B, H, _, K = W.shape
        V = U.shape[-1]
        Wp, Up, kwp, gcp = (_pieces(x, p) for x in (W, U, kw, gc))
        flags = _flags(doc, p)
        ends = serial_pass(Wp, _augmented(Up, K), kwp, gcp, _identity_start(B, H * p, K, V),
                           *flags, store=False)[0]
        start = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
        entry = _chain(ends[..., V:], ends[..., :V], start, p, reverse=False)
        if output is not None:
            q, P, *rest = output
            output = (_pieces(q, p), _pieces(P, p), *rest)
        outs = list(serial_pass(Wp, Up, kwp, gcp, entry, *flags, store=store, output=output))
        if store:  # chunk-start states [B, Hp, NC / p, ...] and R [B, Hp, Tp / p, V]
            outs[0], outs[1] = _whole(outs[0], p), _whole(outs[1], p)
        final = outs[2 * store]
        outs[2 * store] = final.reshape(B, H, p, *final.shape[2:])[:, :, -1]
        if output is not None:
            outs[-1] = _whole_bthv(outs[-1], p)
        return outs

    return run


def backward(serial_pass, p, transposed=True):
    """``serial_pass`` (``state_mosaic.state_bwd`` with ``interpret`` bound) over p pieces in
    parallel: the same signature and results (module docstring). G is [B, H, NC, V, K] if
    ``transposed`` (Mosaic's), else [B, H, NC, K, V]; ``products`` (the pass forms G itself)
    are Mosaic's (q, do, scale)."""
    def run(W, kw, gc, A, G, dfinal, doc, first, last, *, products=None):
        B, H, _, K = W.shape
        V = A.shape[-1]
        Wp, kwp, gcp, Ap = (_pieces(x, p) for x in (W, kw, gc, A))
        Gp = None if G is None else _pieces(G, p)
        flags = _flags(doc, p)
        if products is not None:
            q, do, scale = products
            qp, dop = _pieces(q, p), _pieces_bthv(do, p)
            products_a, products = (qp, _augmented(dop, K), scale), (qp, dop, scale)
        else:
            products_a = None
        G_a = None  # G with K zero value columns (the axis before the last if transposed)
        if Gp is not None:
            G_a = (jnp.swapaxes(_augmented(jnp.swapaxes(Gp, -1, -2), K), -1, -2) if transposed
                   else _augmented(Gp, K))
        starts = serial_pass(Wp, kwp, gcp, _augmented(Ap, K), G_a,
                             _identity_start(B, H * p, K, V), *flags, products=products_a)[2]
        exits = _chain(starts[..., V:], starts[..., :V], dfinal, p, reverse=True)
        dU, dstates, dinit = serial_pass(Wp, kwp, gcp, Ap, Gp, exits, *flags, products=products)
        return (_whole(dU, p), _whole(dstates, p),
                dinit.reshape(B, H, p, *dinit.shape[2:])[:, :, 0])

    return run
