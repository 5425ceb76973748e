"""A float32 NumPy model of OSDN's phase 1 (the d scan, SPEC 3.1) cut into P pieces of the
sequence that run in parallel: how many passes over the pieces each way of guessing the
states entering them needs before every piece starts from the sequential scan's state (to
float32 level, and bit for bit). It sizes NOTES' lever "more CTAs a head" (session 45, item 1)
before any kernel: P pieces at n passes shorten the chain ~P / n times.

    PYTHONPATH=. python benchmarks/pieces_model.py [--T 2048] [--heads 4] [--vanilla]
        [--pieces 2 4 8 16] [--preset deltanet-340m [--preconditioner osgm]]

The token step (the kernels' fixed point, ``reference.osgm``'s order of operations), every
head of row 0 at once, d [H, K]:

    a_t = ⟨d_t, s_t⟩    d_{t+1} = clip(r_t d_t + w_t (1 − g_t a_t) s_t, d_min, d_max)

A pass runs every piece from its entering guess E_p and sets E_{p+1} to the state leaving
piece p (E_0 = d_1, exact): a Picard iteration over pieces, exact after P − 1 passes by
causality. The first guesses:

    start:   E_p = d_1 for every piece
    floor:   E_p = d_min (APF's retention pins most coordinates there)
    affine:  the unclipped maps composed, E_{p+1} = M_p E_p + c_p with
             M_p = Π_t (r_t I − w_t g_t s_t s_tᵀ), c_p their offsets (float64; a K x K pass
             a piece, i.e. a delta rule with keys s_t and one value column)

It prints, per guess and P, the largest relative error of the E_p against the sequential
float32 scan's states after 0 and 1 passes, the pass that makes them equal bit for bit (within
3), the share of token steps whose clip acted, and the float32 scan's own distance from a
float64 one (the level below which the pieces' error is rounding). ``--preset``: the same for
each layer's inputs in a prefill of a random prompt through that model at random init
(``layer_inputs``).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_generate import model_for
from benchmarks.bench_osgm import make_inputs
from precond_linattn.chunked.osgm_picard import coefficients

F32 = np.float32
BOUNDS = (0.5, 2.0)


def scan(d, s, w, g, r, dtype=F32):
    """d after the tokens of s, w, g, r ([T, H, K] / [T, H]) from d [H, K], rounded to
    ``dtype`` each step, and how many (token, head, coordinate) steps the clip changed."""
    clipped = 0
    d = d.astype(dtype)
    for t in range(s.shape[0]):
        a = (d * s[t]).sum(-1, dtype=dtype)
        p = (r[t][:, None] * d + (w[t] * (1 - g[t] * a))[:, None] * s[t]).astype(dtype)
        d = np.clip(p, *BOUNDS).astype(dtype)
        clipped += int(np.sum(d != p))
    return d, clipped


def affine_map(s, w, g, r):
    """(M [H, K, K], c [H, K]) float64 with d_out = M d_in + c for the tokens' unclipped steps."""
    H, K = s.shape[1:]
    M = np.broadcast_to(np.eye(K), (H, K, K)).copy()
    c = np.zeros((H, K))
    for t in range(s.shape[0]):
        st, wg = s[t].astype(np.float64), w[t].astype(np.float64) * g[t]
        M = r[t][:, None, None] * M - wg[:, None, None] * st[:, :, None] * np.einsum(
            "hk,hkj->hj", st, M)[:, None, :]
        c = r[t][:, None] * c - (wg * np.einsum("hk,hk->h", st, c))[:, None] * st + w[t][:, None] * st
    return M, c


def passes(guess, truth, pieces, d1, most=3):
    """The largest relative error of the entering states against ``truth`` after 0 .. ``most``
    passes of the Picard iteration over pieces from ``guess`` [P, H, K] (``pieces``: each
    piece's (s, w, g, r)), and the passes until bit for bit (None: not within ``most``)."""
    E, errors, exact = guess.copy(), [], None
    E[0] = d1
    for n in range(most + 1):
        if n:
            E = np.concatenate([d1[None], [scan(E[p], *pieces[p])[0]
                                           for p in range(len(pieces) - 1)]])
        errors.append(float(np.max(np.abs(E - truth) / np.abs(truth))))
        if exact is None and np.array_equal(E, truth):
            exact = n
    return errors, exact


def row_coefficients(k, beta, retention, eta, beta_aware=True, eps=1e-6):
    """(s [T, H, K], w, g, r [T, H]) float32 NumPy of row 0 (``osgm_picard.coefficients``)."""
    f = lambda v: None if v is None else jnp.asarray(v, jnp.float32)  # noqa: E731
    s, _, g, w, r = (np.asarray(c, F32)[0] for c in coefficients(
        f(k), f(beta), f(retention), eta, beta_aware, eps))
    return s, w, g, r


def coefficients_of(x, vanilla, eta):
    """(s, w, g, r, d_1 [H, K]) of row 0 of ``bench_osgm``'s inputs (``row_coefficients``)."""
    return (*row_coefficients(x["k"], x["beta"], None if vanilla else x["r"], eta),
            np.asarray(x["d0"][0], F32))


def entering_states(d1, pieces):
    """The states entering each piece by the sequential scan [P, H, K]: float32, float64, and
    how many steps the clip changed before the last piece."""
    truth, exact, d, d64, clipped = [d1], [d1], d1, d1, 0
    for piece in pieces[:-1]:
        d, c = scan(d, *piece)
        d64 = scan(d64, *piece, dtype=np.float64)[0]
        truth.append(d)
        exact.append(d64)
        clipped += c
    return np.stack(truth), np.stack(exact), clipped


def composed_states(d1, pieces):
    """The entering states [P, H, K] (float32) by the pieces' unclipped maps composed."""
    states = [d1.astype(np.float64)]
    for piece in pieces[:-1]:
        M, c = affine_map(*piece)
        states.append(np.einsum("hkj,hj->hk", M, states[-1]) + c)
    return np.stack(states).astype(F32)


def cut(coefs, P):
    """``coefs`` (s, w, g, r) as P pieces of the sequence."""
    n = coefs[0].shape[0] // P
    return [tuple(c[i:i + n] for c in coefs) for i in range(0, coefs[0].shape[0], n)]


def layer_inputs(model, prompt):
    """Each OSGM layer's (s, w, g, r, d_1) for row 0 in ``model.prefill(prompt)``: the inputs
    phase 1 meets in a model, caught at the layers' ``osgm_precondition`` call; and the
    prefill's cache."""
    from precond_linattn.layers import attention

    real, seen = attention.osgm_precondition, []

    def record(k, beta, *, initial_state=None, retention=None, **options):
        if (options["d_min"], options["d_max"]) != BOUNDS:
            raise ValueError(f"the model's box is {BOUNDS}, the layer's ({options['d_min']}, "
                             f"{options['d_max']})")
        coefs = row_coefficients(k, beta, retention, options["eta"], options["beta_aware"],
                                 options["eps"])
        d1 = np.ones(coefs[0].shape[1:], F32) if initial_state is None else np.asarray(
            initial_state[0], F32)
        seen.append((*coefs, d1))
        return real(k, beta, initial_state=initial_state, retention=retention, **options)

    attention.osgm_precondition = record
    try:
        _, cache = model.prefill(prompt)
    finally:
        attention.osgm_precondition = real
    return seen, cache


def report(label, coefs, d1, P):
    """One line: the clip's share of the steps, the float32 scan's distance from float64, the
    largest relative error of the entering states by each guess after 0 and 1 passes, and the
    passes each needs for the bits (None: more than 3)."""
    pieces = cut(coefs, P)
    truth, exact, clipped = entering_states(d1, pieces)
    steps = truth[1:].size * coefs[0].shape[0] // P
    line = (f"{label} P={P}: clip {clipped / steps:6.1%}, f32 vs f64 "
            f"{np.max(np.abs(exact - truth) / np.abs(truth)):.1e}")
    guesses = dict(start=np.broadcast_to(d1, truth.shape),
                   floor=np.full(truth.shape, BOUNDS[0], F32),
                   affine=composed_states(d1, pieces))
    for name, guess in guesses.items():
        errors, bitwise = passes(guess, truth, pieces, d1)
        line += f" | {name} {errors[0]:.1e} {errors[1]:.1e} bits@{bitwise}"
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vanilla", action="store_true", help="OSDN without APF retention")
    ap.add_argument("--pieces", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--eta", type=float, default=0.003)
    ap.add_argument("--preset", help="each layer's inputs in a prefill of this preset instead "
                    "(random init; --heads, --eta and --vanilla do not apply)")
    ap.add_argument("--preconditioner", default="osgm", choices=("osgm", "osgm_apf"))
    a = ap.parse_args()
    for P in a.pieces:
        if a.T % P:
            ap.error(f"--pieces must divide --T, got {P}")
    if a.preset:
        model = model_for(a.preset, a.preconditioner)
        prompt = jax.random.randint(jax.random.PRNGKey(0), (1, a.T), 0, model.config.vocab_size)
        cases = [(f"layer {i:2d}", coefs, d1) for i, (*coefs, d1) in
                 enumerate(layer_inputs(model, prompt)[0])]
        print(f"{a.preset}/{a.preconditioner}, a {a.T}-token prefill, random init:")
    else:
        x, _ = make_inputs(jax.random.PRNGKey(0), 1, a.T, a.heads, 128, jnp.bfloat16)
        *coefs, d1 = coefficients_of(x, a.vanilla, a.eta)
        cases = [("bench", coefs, d1)]
        print(f"{'OSDN' if a.vanilla else 'OSDN-APF'}, 1x{a.T}x{a.heads}x128 bf16 inputs, eta "
              f"{a.eta}:")
    print("the pieces' entering states against the sequential scan's: largest relative error "
          "of each guess after 0 and 1 passes, and the passes to the bits")
    for label, coefs, d1 in cases:
        for P in a.pieces:
            report(label, coefs, d1, P)


if __name__ == "__main__":
    main()
