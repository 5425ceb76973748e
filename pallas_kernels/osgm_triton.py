"""The OSGM / OSDN d scan (SPEC 3.1) as Pallas Triton-lowered kernels, forward and reverse.

One program per (batch row, head) walks its tokens in order with d [K] in registers (float32):

    s = k ⊙ k    n̄ = max(Σ s, ε)    g = β (beta-aware) or 1    w = η g / n̄
    a = ⟨d, s⟩   u = w (1 − g a)    p = r d + u s              (p: the pre-clip value)
    k̃_t = d ⊙ k                     d ← clip(p, d_min, d_max)  (derivative m = d_min < p < d_max)

The backward kernel runs the same token loop in reverse with λ = ∂L/∂d_{t+1} in registers and
d_t read back from a buffer the forward kernel writes in its ``emit_d`` mode (recomputed in the
backward, never kept as a residual). With μ = m ⊙ λ, γ_u = ⟨μ, s⟩ and γ_a = −γ_u w g:

    ∂L/∂d_t = r μ + γ_a s + ∂k̃ ⊙ k        ∂L/∂r = ⟨μ, d⟩
    ∂L/∂s   = u μ + γ_a d + [Σ s > ε] γ_n   γ_n = −γ_u (1 − g a) w / n̄
    ∂L/∂k   = 2 k ⊙ ∂L/∂s + ∂k̃ ⊙ d         ∂L/∂β = −γ_u w a + γ_u (1 − g a) η / n̄  (beta-aware)

Layout: k [B, T, H, K] (K a power of two, padded keys zero); the per-token scalars travel in one
float32 row ``aux`` [B, T, H, AUX] = (β, r, document, first, last, 0, 0, 0) so that a token costs
two row loads (``scalar_aux``: one scalar load per column it uses instead of the aux row and its
masked-sum column extractions). A loop iteration takes ``unroll`` consecutive tokens (the last
T mod ``unroll`` form one shorter group after the loop, before it in reverse): first everything
of those tokens that does not depend on the carried d (λ in the backward: there also a, u, p and
m, d_t being loaded), then the serial steps, so that this work (Σ s, the column extractions;
a in the backward) and the off-chain stores can overlap the next tokens' chain of warp
reductions instead of waiting behind it; the rows are loaded ``prefetch`` iterations ahead
(unhidden global-load latency would dominate a token's short chain). ``unroll`` changes the
order of issue only: the arithmetic of each token is the same. Dense batches (``packed`` False)
map each row's initial and final state by BlockSpec and ignore the document columns; packed
documents (B = 1) restart d from initial[doc] at a document's first token and store final[doc]
after its last (inside a group too).

``blocked`` groups shorten the serial chain from one warp reduction per token to about one per
group of n = ``unroll`` tokens; the same equations, only the rounding order differs.

Forward (guess, solve, verify, fall back). Guess: no coordinate changes side of the clip within
the group: the free ones F = (d_min < d_0 < d_max) stay strictly inside, the others stay on
their bound b = clip(d_0) (pinned; d_0 itself at the first token, which may lie outside the box
for an initial state). With R_{j,i} = Π_{l=j}^{i−1} r_l (R_{i,i} = 1) the free coordinates are
affine in the u's, d_i = R_{0,i} d_0 + Σ_{j<i} R_{j+1,i} u_j s_j, so

    a_i = c_i + Σ_{j<i} R_{j+1,i} u_j G_ij    c_i = ⟨where(F, R_{0,i} d_0, b), s_i⟩ (c_0 = ⟨d_0, s_0⟩)
    G_ij = ⟨F ⊙ s_j, s_i⟩                      u_i = w_i (1 − g_i a_i)

with all c_i and G_ij independent reductions issued together, then the u_i by an n-step scalar
recurrence, then d_{i+1} = where(F, p_i, b) by vector multiply-adds. Verify: one max-reduction
over K of "a free p_i not strictly inside, or a pinned p_i that the clip would not put back on
b". If the guess failed (or, packed, a document starts or ends in the group) the group is redone
by the exact token loop from d_0 (``lax.cond``: the k̃ rows are stored only by the branch taken).
``osgm_fwd(verify=False)`` (tests only) always keeps the guess.

Backward (exact, no guess: the masks m_i are known from the stored d_t). With λ_n = λ at the
group's end, the vector products A_{i+1} = Π_{l=i+1}^{n−1} r_l m_l, B_{i+1,j} = Π_{l=i+1}^{j−1}
r_l m_l (B_{j,j} = 1) and e_i = ∂k̃_i ⊙ k_i, unrolling λ_{i+1} gives

    γ_u,i = ⟨λ_n, q_i⟩ + E_i + Σ_{j>i} γ_a,j H_ij       q_i = m_i ⊙ A_{i+1} ⊙ s_i
    H_ij = ⟨m_i ⊙ B_{i+1,j} ⊙ s_j, s_i⟩                E_i = ⟨m_i ⊙ Z_{i+1}, s_i⟩
    Z_n = 0, Z_i = e_i + r_i m_i ⊙ Z_{i+1}

Only the n reductions with λ_n are on the chain (issued together); q, H, E are not. Then the
γ's by an n-step scalar recurrence (i descending) and each token as in the token loop with its
γ_u given (λ by vector multiply-adds; ∂r's reduction is off the chain). Packed: a group holding
a document's first or last token runs the token loop (``lax.cond``). The couplings G (forward)
and H (backward) are n(n − 1)/2 reductions per group: the work and working set grow
quadratically with ``unroll`` (28 pairs at 8).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.triton_common import column, out_struct, prefetched_loop
from precond_linattn.reference.osgm import clip_box

AUX = 8  # columns of the per-token row: beta, retention, doc, first, last, (unused)
BETA, RET, DOC, FIRST, LAST = range(5)


class _Coefs(NamedTuple):
    """One token's d-independent coefficients (module docstring)."""

    s: jax.Array  # k ⊙ k
    ss: jax.Array  # Σ s
    n: jax.Array  # n̄ = max(Σ s, ε)
    g: jax.Array | float  # β (beta-aware) or 1
    w: jax.Array  # η g / n̄
    r: jax.Array  # retention


def _columns(coefs, *fields):
    """Per field, the list of that field over a group's ``_Coefs``."""
    return [[getattr(c, f) for c in coefs] for f in fields]


def _aux_columns(beta_aware, packed):
    """The aux columns a kernel reads."""
    return ((BETA,) if beta_aware else ()) + (RET,) + ((DOC, FIRST, LAST) if packed else ())


def _load_aux(aux_ref, t, columns, scalar_aux):
    """Token t's aux: its row, or with ``scalar_aux`` {column: scalar} by one scalar load each."""
    return {c: aux_ref[t, c] for c in columns} if scalar_aux else aux_ref[t]


def _scalars(aux, columns, scalar_aux):
    """{column: scalar} of a token's loaded aux (a row's columns extracted by ``column``)."""
    return aux if scalar_aux else {c: column(aux, c) for c in columns}


def _coefficients(k, sc, eta, eps, beta_aware):
    """``_Coefs`` (s, Σ s, n̄, g, w, r) of one token from its key row and aux scalars ``sc``."""
    s = k * k
    ss = jnp.sum(s)
    n = jnp.maximum(ss, eps)
    g = sc[BETA] if beta_aware else 1.0
    return _Coefs(s, ss, n, g, eta * g / n, sc[RET])


def _free(p, d_min, d_max):
    """The clip's derivative as a mask: d_min < p < d_max (``clip_box``: 0 on and beyond a bound)."""
    return (p > d_min) & (p < d_max)


def _has_boundary(scalars):
    """Whether a group's tokens (their aux scalars) hold a document's first or last token."""
    return sum(sc[FIRST] + sc[LAST] for sc in scalars) != 0


def _decays(r):
    """R[j][i] = Π_{l=j}^{i−1} r_l for 0 <= j <= i < n = len(r) (R[i][i] = 1): the retention from
    token j to token i of a group (0-d scalars; entries j > i unused)."""
    R = [[1.0] * len(r) for _ in r]
    for i in range(len(r)):
        for j in reversed(range(i)):
            R[j][i] = r[j] * R[j + 1][i]
    return R


def _guess_reductions(d0, free, bound, s, R):
    """(c, G) of the forward guess: c_i = ⟨where(F, R_{0,i} d_0, b), s_i⟩ (c_0 = ⟨d_0, s_0⟩) and
    G_ij = ⟨F ⊙ s_j, s_i⟩ for j < i (G[i][j]): every reduction of the group, all independent."""
    c = [jnp.sum(d0 * s[0])] + [jnp.sum(jnp.where(free, R[0][i] * d0, bound) * s[i])
                                for i in range(1, len(s))]
    fs = [jnp.where(free, sj, 0.0) for sj in s[:-1]]
    return c, [[jnp.sum(fs[j] * si) for j in range(i)] for i, si in enumerate(s)]


def _guess_solve(c, G, R, w, g):
    """u_i = w_i (1 − g_i a_i), a_i = c_i + Σ_{j<i} R_{j+1,i} G_ij u_j for i in order (0-d scalars;
    the newest u_{i−1} added last, so the chain per token is a multiply-add and the u step)."""
    u = []
    for i, a in enumerate(c):
        for j in range(i):
            a = a + R[j + 1][i] * G[i][j] * u[j]
        u.append(w[i] * (1.0 - g[i] * a))
    return u


def _guess_states(d0, free, bound, r, u, s, d_min, d_max):
    """d_{i+1} = where(F, p_i, b), p_i = r_i d_i + u_i s_i from d_0 = d0: ([d_0, …, d_n], whether
    the guess failed): a free p_i not strictly inside the box, or a pinned one that the clip would
    not put back on its bound (``clip_box(p_i) != b``), by one max-reduction over K."""
    ds, bad = [d0], False
    for ri, ui, si in zip(r, u, s):
        p = ri * ds[-1] + ui * si
        bad = bad | jnp.where(free, ~_free(p, d_min, d_max), clip_box(p, d_min, d_max) != bound)
        ds.append(jnp.where(free, p, bound))
    return ds, jnp.max(jnp.where(bad, 1.0, 0.0)) > 0.0


def _carried_back(x, top, m, r, inject=None):
    """[μ_0, …, μ_{top−1}] of the reverse recurrence's vector part μ_i = m_i ⊙ x_{i+1},
    x_i = r_i μ_i (+ inject_i) for i descending from x_top = x (no reductions): with x_top = v and
    no injections μ_i = m_i ⊙ B_{i+1,top} ⊙ v."""
    mu = [None] * top
    for i in reversed(range(top)):
        mu[i] = jnp.where(m[i], x, 0.0)
        x = r[i] * mu[i] if inject is None else r[i] * mu[i] + inject[i]
    return mu


def _adjoint_couplings(m, r, s, e):
    """(q, H, E): the λ-independent parts of γ_u,i = ⟨λ_n, q_i⟩ + E_i + Σ_{j>i} γ_a,j H_ij (module
    docstring): q_i = m_i ⊙ A_{i+1} ⊙ s_i, H_ij = ⟨m_i ⊙ B_{i+1,j} ⊙ s_j, s_i⟩ (H[i][j], i < j),
    E_i = ⟨m_i ⊙ Z_{i+1}, s_i⟩ (E_{n−1} = 0)."""
    n = len(m)
    q = [mu * si for mu, si in zip(_carried_back(jnp.ones_like(s[0]), n, m, r), s)]
    H = [[None] * n for _ in range(n)]
    for j in range(1, n):
        for i, mu in enumerate(_carried_back(s[j], j, m, r)):
            H[i][j] = jnp.sum(mu * s[i])
    E = [jnp.sum(mu * si) for mu, si in zip(_carried_back(e[-1], n - 1, m, r, e), s)]
    return q, H, E + [0.0]


def _adjoint_solve(lam, q, H, E, w, g):
    """[γ_u,i]: γ_u,i = ⟨λ_n, q_i⟩ + E_i + Σ_{j>i} γ_a,j H_ij, γ_a,i = −γ_u,i w_i g_i for i
    descending (the n reductions with λ_n, the chain's only ones, issued together; then 0-d
    scalars, the newest γ_a,{i+1} added last)."""
    x = [jnp.sum(lam * qi) for qi in q]
    gu, ga = [None] * len(q), [None] * len(q)
    for i in reversed(range(len(q))):
        acc = x[i] + E[i]
        for j in reversed(range(i + 1, len(q))):
            acc = acc + ga[j] * H[i][j]
        gu[i], ga[i] = acc, -acc * w[i] * g[i]
    return gu


def _token_loop(T, reverse, unroll, prefetch, loads, group, carry):
    """``group(t0, rows, carry) -> carry`` over the tokens [0, T) in groups of ``unroll``
    consecutive tokens [t0, t0 + len(rows)), the groups in order (descending if ``reverse``),
    ``rows[u] = loads(t0 + u)`` issued ``prefetch`` groups ahead by ``prefetched_loop``. The last
    T mod ``unroll`` tokens form one shorter group, run last (first if ``reverse``), its rows
    loaded in place."""
    n, tail = divmod(T, unroll)

    def last_group(carry):
        t0 = T - tail
        return group(t0, tuple(loads(t0 + u) for u in range(tail)), carry) if tail else carry

    if reverse:
        carry = last_group(carry)
    if n:
        carry = prefetched_loop(
            n, reverse, prefetch, lambda i: tuple(loads(i * unroll + u) for u in range(unroll)),
            lambda i, rows, c: group(i * unroll, rows, c), carry)
    return carry if reverse else last_group(carry)


def _fwd_kernel(k_ref, aux_ref, init_ref, out_ref, final_ref, *, hyper, beta_aware, packed,
                emit_d, prefetch, unroll, scalar_aux, blocked, verify):
    """k̃_t = d_t ⊙ k_t (or d_t itself if ``emit_d``), d_{t+1} = clip(r d_t + u s, d_min, d_max)
    for t in order (``blocked``: per group by the guess, verified unless ``verify`` is False);
    the final d (per document if ``packed``)."""
    eta, d_min, d_max, eps = hyper
    columns = _aux_columns(beta_aware, packed)

    def loads(t):
        return k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux)

    def emit(t, d, k):
        """Row t of the output: k̃_t = d_t ⊙ k_t, or d_t."""
        out_ref[t] = d if emit_d else (d * k).astype(out_ref.dtype)

    def exact(t0, rows, tokens, d):
        """The token loop over one group from d (restarts and final states of documents)."""
        for u, ((k, _), (sc, c)) in enumerate(zip(rows, tokens)):
            if packed:
                doc = sc[DOC].astype(jnp.int32)
                d = lax.cond(sc[FIRST] != 0, lambda: init_ref[doc], lambda: d)
            emit(t0 + u, d, k)
            d = clip_box(c.r * d + c.w * (1.0 - c.g * jnp.sum(d * c.s)) * c.s, d_min, d_max)
            if packed:
                @pl.when(sc[LAST] != 0)
                def _():
                    final_ref[doc] = d
        return d

    def guessed(t0, rows, tokens, d0):
        """The group from d0 under the guess (module docstring); ``exact`` from d0 instead where
        the guess failed or a document starts or ends in the group (unless not ``verify``)."""
        s, w, g, r = _columns([c for _, c in tokens], "s", "w", "g", "r")
        free, bound = _free(d0, d_min, d_max), clip_box(d0, d_min, d_max)
        R = _decays(r)
        u = _guess_solve(*_guess_reductions(d0, free, bound, s, R), R, w, g)
        ds, failed = _guess_states(d0, free, bound, r, u, s, d_min, d_max)

        def store():
            for i, ((k, _), d) in enumerate(zip(rows, ds)):
                emit(t0 + i, d, k)
            return ds[-1]

        if not verify:
            return store()
        if packed:
            failed = failed | _has_boundary([sc for sc, _ in tokens])
        return lax.cond(failed, lambda: exact(t0, rows, tokens, d0), store)

    def group(t0, rows, d):
        scalars = [_scalars(aux, columns, scalar_aux) for _, aux in rows]  # d-independent first
        tokens = [(sc, _coefficients(k, sc, eta, eps, beta_aware))
                  for (k, _), sc in zip(rows, scalars)]
        return (guessed if blocked else exact)(t0, rows, tokens, d)

    d0 = jnp.ones(k_ref.shape[-1:], jnp.float32) if packed else init_ref[...]
    d = _token_loop(k_ref.shape[0], False, unroll, prefetch, loads, group, d0)
    if not packed:
        final_ref[...] = d


def _bwd_kernel(k_ref, aux_ref, d_ref, dkw_ref, dfinal_ref, dk_ref, daux_ref, dinit_ref, *,
                hyper, beta_aware, packed, prefetch, unroll, scalar_aux, blocked):
    """The module docstring's reverse recurrence λ ← r μ + γ_a s + ∂k̃ ⊙ k for t descending (per
    group by ``_adjoint_solve`` if ``blocked``), with ∂k_t, ∂β_t, ∂r_t per token and ∂d_1 = λ
    (per document if ``packed``)."""
    eta, d_min, d_max, eps = hyper
    columns = _aux_columns(beta_aware, packed)
    col = lax.broadcasted_iota(jnp.int32, (AUX,), 0)

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                d_ref[t], dkw_ref[t].astype(jnp.float32))

    def prepare(k, aux, d):
        """Everything of one token that does not depend on λ (the forward's step from d_t):
        (aux scalars, ``_Coefs``, a, 1 − g a, u, m)."""
        sc = _scalars(aux, columns, scalar_aux)
        c = _coefficients(k, sc, eta, eps, beta_aware)
        a = jnp.sum(d * c.s)
        v = 1.0 - c.g * a
        u = c.w * v
        return sc, c, a, v, u, _free(c.r * d + u * c.s, d_min, d_max)

    def token(t, row, prepared, lam, gu=None):
        """Token t's cotangents from λ = ∂L/∂d_{t+1} (γ_u = ⟨μ, s⟩ unless given); returns
        ∂L/∂d_t = r μ + γ_a s + ∂k̃ ⊙ k."""
        k, _, d, dkw = row
        _, c, a, v, u, free = prepared
        mu = jnp.where(free, lam, 0.0)
        gu = jnp.sum(mu * c.s) if gu is None else gu
        ga = -gu * c.w * c.g
        gn = jnp.where(c.ss > eps, -gu * v * c.w / c.n, 0.0)
        dk_ref[t] = 2.0 * k * (u * mu + ga * d + gn) + dkw * d
        dbeta = (-gu * c.w * a + gu * v * eta / c.n) if beta_aware else 0.0
        daux_ref[t] = jnp.where(col == BETA, dbeta, jnp.where(col == RET, jnp.sum(mu * d), 0.0))
        return c.r * mu + ga * c.s + dkw * k

    def exact(t0, rows, prepared, lam):
        """The reverse token loop over one group (restarts and final states of documents)."""
        for i in reversed(range(len(rows))):
            sc = prepared[i][0]
            if packed:
                doc = sc[DOC].astype(jnp.int32)
                lam = lax.cond(sc[LAST] != 0, lambda: dfinal_ref[doc], lambda: lam)
            lam = token(t0 + i, rows[i], prepared[i], lam)
            if packed:
                @pl.when(sc[FIRST] != 0)
                def _():
                    dinit_ref[doc] = lam
        return lam

    def solved(t0, rows, prepared, lam):
        """The group with every γ_u from ``_adjoint_solve`` (no document boundary inside)."""
        m = [p[5] for p in prepared]
        s, w, g, r = _columns([p[1] for p in prepared], "s", "w", "g", "r")
        q, H, E = _adjoint_couplings(m, r, s, [dkw * k for k, _, _, dkw in rows])
        gu = _adjoint_solve(lam, q, H, E, w, g)
        for i in reversed(range(len(rows))):
            lam = token(t0 + i, rows[i], prepared[i], lam, gu[i])
        return lam

    def group(t0, rows, lam):
        prepared = [prepare(k, aux, d) for k, aux, d, _ in rows]  # λ-independent first
        if not blocked:
            return exact(t0, rows, prepared, lam)
        if not packed:
            return solved(t0, rows, prepared, lam)
        return lax.cond(_has_boundary([p[0] for p in prepared]),
                        lambda: exact(t0, rows, prepared, lam),
                        lambda: solved(t0, rows, prepared, lam))

    lam0 = jnp.zeros(k_ref.shape[-1:], jnp.float32) if packed else dfinal_ref[...]
    lam = _token_loop(k_ref.shape[0], True, unroll, prefetch, loads, group, lam0)
    if not packed:
        dinit_ref[...] = lam


def _specs(T, K, num_docs, packed):
    seq_k = pl.BlockSpec((None, T, None, K), lambda b, h: (b, 0, h, 0))
    seq_aux = pl.BlockSpec((None, T, None, AUX), lambda b, h: (b, 0, h, 0))
    if packed:
        state = pl.BlockSpec((num_docs, None, K), lambda b, h: (0, h, 0))
    else:
        state = pl.BlockSpec((None, None, K), lambda b, h: (b, h, 0))
    return seq_k, seq_aux, state


def osgm_fwd(k, aux, initial_state, *, hyper, beta_aware, packed, emit_d, prefetch, num_warps,
             unroll, scalar_aux, blocked, interpret, verify=True):
    """k [B, T, H, K]; aux [B, T, H, AUX] float32; initial_state [N, H, K] float32 (N = B unless
    ``packed``). Returns (k̃ in k's dtype, or every d_t float32 if ``emit_d``; final d [N, H, K]).
    ``verify=False`` (tests only, with ``blocked``): keep every group's guess, wrong where it
    fails."""
    B, T, H, K = k.shape
    N = initial_state.shape[0]
    seq_k, seq_aux, state = _specs(T, K, N, packed)
    kernel = functools.partial(_fwd_kernel, hyper=hyper, beta_aware=beta_aware, packed=packed,
                               emit_d=emit_d, prefetch=prefetch, unroll=unroll,
                               scalar_aux=scalar_aux, blocked=blocked, verify=verify)
    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[seq_k, seq_aux, state], out_specs=[seq_k, state],
        out_shape=[out_struct(k.shape, jnp.float32 if emit_d else k.dtype, k, aux, initial_state),
                   out_struct((N, H, K), jnp.float32, k, aux, initial_state)],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="osgm_fwd",
    )(k, aux, initial_state)


def osgm_bwd(k, aux, d, dkw, dfinal, *, hyper, beta_aware, packed, prefetch, num_warps, unroll,
             scalar_aux, blocked, interpret):
    """Cotangents (dk [B, T, H, K], daux [B, T, H, AUX] (β and r columns), dinit [N, H, K]), all
    float32, from d [B, T, H, K] (``osgm_fwd(emit_d=True)``), dk̃ and dfinal."""
    B, T, H, K = k.shape
    N = dfinal.shape[0]
    seq_k, seq_aux, state = _specs(T, K, N, packed)
    kernel = functools.partial(_bwd_kernel, hyper=hyper, beta_aware=beta_aware, packed=packed,
                               prefetch=prefetch, unroll=unroll, scalar_aux=scalar_aux,
                               blocked=blocked)
    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[seq_k, seq_aux, seq_k, seq_k, state],
        out_specs=[seq_k, seq_aux, state],
        out_shape=[out_struct(shape, jnp.float32, k, aux, d, dkw, dfinal)
                   for shape in (k.shape, aux.shape, (N, H, K))],
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="osgm_bwd",
    )(k, aux, d, dkw, dfinal)
