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
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.triton_common import column, out_struct, prefetched_loop
from precond_linattn.reference.osgm import clip_box

AUX = 8  # columns of the per-token row: beta, retention, doc, first, last, (unused)
BETA, RET, DOC, FIRST, LAST = range(5)


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
    """(s, Σ s, n̄, g, w, r) of one token from its key row and aux scalars ``sc``."""
    s = k * k
    ss = jnp.sum(s)
    n = jnp.maximum(ss, eps)
    g = sc[BETA] if beta_aware else 1.0
    return s, ss, n, g, eta * g / n, sc[RET]


def _at_boundary(sc, flag, ref, value):
    """(doc, ref[doc]) if the token's ``flag`` column is set, else (doc, value): a document's
    state entering (packed token loops)."""
    doc = sc[DOC].astype(jnp.int32)
    return doc, lax.cond(sc[flag] != 0, lambda: ref[doc], lambda: value)


def _store_at(sc, flag, ref, doc, value):
    """ref[doc] = value if the token's ``flag`` column is set: a document's state leaving."""
    @pl.when(sc[flag] != 0)
    def _():
        ref[doc] = value


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


def _unless_skipped(refs, n_in, skippable, body):
    """``body(*inputs, *outputs)``, or with ``skippable`` (the inputs then followed by a [1] skip
    flag and the given results, which the outputs alias) only where the flag is 0: elsewhere
    the outputs keep the given results."""
    if not skippable:
        return body(*refs)
    n_out = (len(refs) - n_in - 1) // 2
    skip_ref, outs = refs[n_in], refs[len(refs) - n_out:]
    pl.when(skip_ref[0] == 0)(lambda: body(*refs[:n_in], *outs))


def _fwd_kernel(*refs, skippable, **static):
    """``_fwd``, unless skipped (``_unless_skipped``)."""
    _unless_skipped(refs, 3, skippable, functools.partial(_fwd, **static))


def _fwd(k_ref, aux_ref, init_ref, out_ref, final_ref, *, hyper, beta_aware, packed, emit_d,
         prefetch, unroll, scalar_aux):
    """k̃_t = d_t ⊙ k_t (or d_t itself if ``emit_d``), d_{t+1} = clip(r d_t + u s, d_min, d_max)
    for t in order; the final d (per document if ``packed``)."""
    eta, d_min, d_max, eps = hyper
    columns = _aux_columns(beta_aware, packed)

    def loads(t):
        return k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux)

    def group(t0, rows, d):
        scalars = [_scalars(aux, columns, scalar_aux) for _, aux in rows]  # d-independent first
        coefs = [_coefficients(k, sc, eta, eps, beta_aware) for (k, _), sc in zip(rows, scalars)]
        for u, ((k, _), sc, (s, _, _, g, w, r)) in enumerate(zip(rows, scalars, coefs)):
            if packed:
                doc, d = _at_boundary(sc, FIRST, init_ref, d)
            out_ref[t0 + u] = d if emit_d else (d * k).astype(out_ref.dtype)
            d = clip_box(r * d + w * (1.0 - g * jnp.sum(d * s)) * s, d_min, d_max)
            if packed:
                _store_at(sc, LAST, final_ref, doc, d)
        return d

    d0 = jnp.ones(k_ref.shape[-1:], jnp.float32) if packed else init_ref[...]
    d = _token_loop(k_ref.shape[0], False, unroll, prefetch, loads, group, d0)
    if not packed:
        final_ref[...] = d


def _bwd_kernel(*refs, skippable, **static):
    """``_bwd``, unless skipped (``_unless_skipped``)."""
    _unless_skipped(refs, 5, skippable, functools.partial(_bwd, **static))


def _bwd(k_ref, aux_ref, d_ref, dkw_ref, dfinal_ref, dk_ref, daux_ref, dinit_ref, *, hyper,
         beta_aware, packed, prefetch, unroll, scalar_aux):
    """The module docstring's reverse recurrence λ ← r μ + γ_a s + ∂k̃ ⊙ k for t descending, with
    ∂k_t, ∂β_t, ∂r_t per token and ∂d_1 = λ (per document if ``packed``)."""
    eta, d_min, d_max, eps = hyper
    columns = _aux_columns(beta_aware, packed)
    col = lax.broadcasted_iota(jnp.int32, (AUX,), 0)

    def loads(t):
        return (k_ref[t].astype(jnp.float32), _load_aux(aux_ref, t, columns, scalar_aux),
                d_ref[t], dkw_ref[t].astype(jnp.float32))

    def prepare(k, aux, d):
        """Everything of one token that does not depend on λ (the forward's step from d_t)."""
        sc = _scalars(aux, columns, scalar_aux)
        s, ss, n, g, w, r = _coefficients(k, sc, eta, eps, beta_aware)
        a = jnp.sum(d * s)
        v = 1.0 - g * a
        u = w * v
        p = r * d + u * s
        return sc, s, ss, n, g, w, r, a, v, u, (p > d_min) & (p < d_max)

    def group(t0, rows, lam):
        prepared = [prepare(k, aux, d) for k, aux, d, _ in rows]  # λ-independent first
        for i in reversed(range(len(rows))):
            k, _, d, dkw = rows[i]
            sc, s, ss, n, g, w, r, a, v, u, free = prepared[i]
            if packed:
                doc, lam = _at_boundary(sc, LAST, dfinal_ref, lam)
            mu = jnp.where(free, lam, 0.0)
            gu = jnp.sum(mu * s)
            ga = -gu * w * g
            gn = jnp.where(ss > eps, -gu * v * w / n, 0.0)
            dk_ref[t0 + i] = 2.0 * k * (u * mu + ga * d + gn) + dkw * d
            dbeta = (-gu * w * a + gu * v * eta / n) if beta_aware else 0.0
            daux_ref[t0 + i] = jnp.where(col == BETA, dbeta,
                                         jnp.where(col == RET, jnp.sum(mu * d), 0.0))
            lam = r * mu + ga * s + dkw * k
            if packed:
                _store_at(sc, FIRST, dinit_ref, doc, lam)
        return lam

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


def _skippable(specs, shapes, skip, results, n_in):
    """In specs, input_output_aliases and extra arguments for ``skip`` [B] int32 (per batch row)
    and the ``results`` that the outputs alias (None: no skipping)."""
    if skip is None:
        return [], {}, []
    flag = pl.BlockSpec((1,), lambda b, h: (b,))
    return [flag] + specs, {n_in + 1 + i: i for i in range(len(shapes))}, [skip, *results]


def osgm_fwd(k, aux, initial_state, skip=None, *results, hyper, beta_aware, packed, emit_d,
             prefetch, num_warps, unroll, scalar_aux, interpret):
    """k [B, T, H, K]; aux [B, T, H, AUX] float32; initial_state [N, H, K] float32 (N = B unless
    ``packed``). Returns (k̃ in k's dtype, or every d_t float32 if ``emit_d``; final d [N, H, K]).
    With ``skip`` [B] int32 and ``results`` (those two, e.g. from Picard sweeps): rows whose
    flag is set keep the given results and run nothing (an exact fallback without a host
    round trip)."""
    B, T, H, K = k.shape
    N = initial_state.shape[0]
    seq_k, seq_aux, state = _specs(T, K, N, packed)
    out_specs = [seq_k, state]
    out_shape = [out_struct(k.shape, jnp.float32 if emit_d else k.dtype, k, aux, initial_state),
                 out_struct((N, H, K), jnp.float32, k, aux, initial_state)]
    extra_specs, aliases, extra = _skippable(out_specs, out_shape, skip, results, 3)
    kernel = functools.partial(_fwd_kernel, skippable=skip is not None, hyper=hyper,
                               beta_aware=beta_aware, packed=packed, emit_d=emit_d,
                               prefetch=prefetch, unroll=unroll, scalar_aux=scalar_aux)
    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[seq_k, seq_aux, state] + extra_specs,
        out_specs=out_specs, out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="osgm_fwd",
    )(k, aux, initial_state, *extra)


def osgm_bwd(k, aux, d, dkw, dfinal, skip=None, *results, hyper, beta_aware, packed, prefetch,
             num_warps, unroll, scalar_aux, interpret):
    """Cotangents (dk [B, T, H, K], daux [B, T, H, AUX] (β and r columns), dinit [N, H, K]), all
    float32, from d [B, T, H, K] (``osgm_fwd(emit_d=True)``), dk̃ and dfinal; ``skip`` and
    ``results`` (those three) as ``osgm_fwd``'s."""
    B, T, H, K = k.shape
    N = dfinal.shape[0]
    seq_k, seq_aux, state = _specs(T, K, N, packed)
    out_specs = [seq_k, seq_aux, state]
    out_shape = [out_struct(shape, jnp.float32, k, aux, d, dkw, dfinal)
                 for shape in (k.shape, aux.shape, (N, H, K))]
    extra_specs, aliases, extra = _skippable(out_specs, out_shape, skip, results, 5)
    kernel = functools.partial(_bwd_kernel, skippable=skip is not None, hyper=hyper,
                               beta_aware=beta_aware, packed=packed, prefetch=prefetch,
                               unroll=unroll, scalar_aux=scalar_aux)
    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[seq_k, seq_aux, seq_k, seq_k, state] + extra_specs,
        out_specs=out_specs, out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="osgm_bwd",
    )(k, aux, d, dkw, dfinal, *extra)
