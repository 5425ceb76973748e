"""Token-loop kernels over sequence pieces: a dense row of T tokens runs as p rows of T / p.

A token loop whose step is a map that composes (ATK's A ↦ α ⊙ A + β k², an OSGM sweep's
clip-affine d ↦ clip(r d + u s, lo, hi), their adjoints) runs in three steps: each piece's map
from its own tokens (one pass, p times the programs), a chain of p map applications in XLA giving
the state entering each piece, and the full pass from those states. A one-warp program's token
loop is latency-bound, so few programs (B · H · K tiles) leave the GPU idle; the split buys p
times the programs for one more pass (RESULTS run 38 for OSGM's loops, run 47 for ATK's).
"""

import jax.numpy as jnp
from jax import lax

from pallas_kernels.sequence_split import SMS

TARGET_PROGRAMS = 8 * SMS  # one-warp programs the auto split aims at (8 an SM)
MIN_PIECE = 128  # tokens a piece keeps at least under the auto split


def auto_pieces(*, programs: int, T: int) -> int:
    """The largest power of two p with programs p <= TARGET_PROGRAMS and T / p >= MIN_PIECE."""
    p = 1
    while 2 * programs * p <= TARGET_PROGRAMS and T // (2 * p) >= MIN_PIECE:
        p *= 2
    return p


def rows(x, p):
    """[B, n, ...] -> [B p, n / p, ...] (row b, piece i -> row b p + i); None stays None."""
    return None if x is None else x.reshape(x.shape[0] * p, x.shape[1] // p, *x.shape[2:])


def unrows(x, p):
    """``rows``' inverse."""
    return x.reshape(x.shape[0] // p, x.shape[1] * p, *x.shape[2:])


def chain(step, maps, start, reverse=False):
    """States entering each piece [B, p, ...]: S_0 = start, S_{i+1} = step(S_i, map_i) (reverse:
    from the last piece down, S_{p−1} = start, S_{i−1} = step(S_i, map_i)); ``maps`` a tuple of
    [B, p, ...] arrays. Unrolled (p is small): straight-line XLA, no device loop."""
    def body(S, m):
        return step(S, m), S

    xs = tuple(jnp.moveaxis(m, 1, 0) for m in maps)
    _, states = lax.scan(body, start, xs, reverse=reverse, unroll=True)
    return jnp.moveaxis(states, 0, 1)
