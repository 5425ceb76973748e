"""The ATK / PDN A-recurrence and squash (SPEC 3.2) as Pallas Triton-lowered kernels, fwd and reverse.

One program per (batch row, head, K tile) walks its tokens in order with A [Kt] in registers
(float32); no reductions over K in the forward, so K tiles are independent programs:

    A_t = α_t ⊙ A_{t−1} + gain_t s_t       α_t = exp(g_t), s_t = k_t ⊙ k_t
    ρ_t = log(A_t + ε) − c_h    σ_t = ρ_t / (1 + |ρ_t|)    B_t = exp(−L σ_t)    k̃_t = B_t ⊙ k_t

with L = log x. Tokens go in blocks of U (``block_t``), unrolled in the loop body so that the U
squash chains (log, divide, exp, store), which nothing downstream in the recurrence waits for,
overlap; the next block's rows are loaded while one block computes. The forward also writes
the state entering each block (``starts`` [B, T/U, H, K], float32): the backward recomputes the
U states of a block from it in registers, with exactly the forward's arithmetic, rather than
storing every A_t (T x K floats) or re-running the whole forward. (A cannot be recovered by
running the recurrence backwards: A_{t−1} = (A_t − gain_t s_t) / α_t loses everything once α
is tiny.)

The reverse loop carries λ = ∂L/∂A_t from the later tokens. With δ = ∂L/∂k̃_t and
q_t = −L δ k_t B_t / (1 + |ρ_t|)² (= ∂L/∂ρ_t):

    Λ_t = λ + q_t / (A_t + ε)         (all of ∂L/∂A_t)
    ∂k_t    = δ B_t + 2 gain_t k_t Λ_t      ∂gain_t = Σ_K Λ_t s_t      ∂c_h −= Σ_K q_t
    ∂g_t    = Λ_t α_t A_{t−1} (per channel, or Σ_K of it per head)     λ ← α_t Λ_t

Layout: k [B, T, H, K] (K a multiple of the tile, padded keys zero; T a multiple of U); the
per-token scalars travel in one float32 ``aux`` row [B, T, H, AUX] = (gain, g (per-head decay),
document, first, last, c_h, 0, 0), with OSGM's document columns; per-channel decay is a
[B, T, H, K] row of its own. Dense batches map each row's initial and final state by BlockSpec;
packed documents (B = 1) restart A from initial[doc] at a document's first token and store
final[doc] after its last (backward: λ restarts from ∂final[doc] there, ∂initial[doc] = α λ at
the first token).
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.osgm_triton import AUX, DOC, FIRST, LAST
from pallas_kernels.triton_common import column, out_struct, prefetched_loop

GAIN, DECAY, CENTER = 0, 1, 5  # aux columns (DOC, FIRST, LAST as OSGM's)


def _token_rows(t, k_ref, aux_ref, g_ref):
    """(k, aux, g or None) of token t as float32 rows."""
    g = None if g_ref is None else g_ref[t].astype(jnp.float32)
    return k_ref[t].astype(jnp.float32), aux_ref[t], g


def _alpha(aux, g):
    """exp(g_t): per channel from the g row, else the per-head aux column."""
    return jnp.exp(column(aux, DECAY) if g is None else g)


def _squash(A, k, aux, hyper):
    """(B_t, 1 + |ρ_t|) for the state A_t and aux row of a token."""
    log_x, eps = hyper
    rho = jnp.log(A + eps) - column(aux, CENTER)
    den = 1.0 + jnp.abs(rho)
    return jnp.exp(-log_x * (rho / den)), den


def _advance(A, rows, init_ref, packed):
    """(A_{t−1} after a document restart, A_t) for one token's rows."""
    k, aux, g = rows
    if packed:
        doc = column(aux, DOC).astype(jnp.int32)
        A = lax.cond(column(aux, FIRST) != 0, lambda: init_ref[doc], lambda: A)
    return A, _alpha(aux, g) * A + column(aux, GAIN) * (k * k)


def _split(refs, has_g, n_out):
    """(inputs with g or None in its slot, outputs) from a kernel's flat ref list."""
    ins, outs = list(refs[:len(refs) - n_out]), refs[len(refs) - n_out:]
    if not has_g:
        ins.insert(2, None)
    return ins, outs


def _fwd_kernel(*refs, hyper, packed, block_t, prefetch, has_g, emit):
    (k_ref, aux_ref, g_ref, init_ref), outs = _split(refs, has_g, 3 if emit else 1)
    out_ref, final_ref, starts_ref = outs if emit else (None, outs[0], None)
    U = block_t

    def loads(i):
        return tuple(_token_rows(i * U + u, k_ref, aux_ref, g_ref) for u in range(U))

    def body(i, rows, A):
        if emit:
            starts_ref[i] = A
        for u in range(U):
            _, A = _advance(A, rows[u], init_ref, packed)
            k, aux, _ = rows[u]
            if emit:
                out_ref[i * U + u] = (_squash(A, k, aux, hyper)[0] * k).astype(out_ref.dtype)
            if packed:
                @pl.when(column(aux, LAST) != 0)
                def _():
                    final_ref[column(aux, DOC).astype(jnp.int32)] = A
        return A

    A0 = jnp.zeros(k_ref.shape[-1:], jnp.float32) if packed else init_ref[...]
    A = prefetched_loop(k_ref.shape[0] // U, False, prefetch, loads, body, A0)
    if not packed:
        final_ref[...] = A


def _bwd_kernel(*refs, hyper, packed, block_t, prefetch, has_g, emit):
    outs = (4 if has_g else 3) if emit else 1
    (k_ref, aux_ref, g_ref, init_ref, starts_ref, dkw_ref, dfinal_ref), out = _split(
        refs, has_g, outs)
    dk_ref, daux_ref, dinit_ref = (out[0], out[1], out[-1]) if emit else (None, None, out[0])
    log_x, eps = hyper
    U = block_t
    col = lax.broadcasted_iota(jnp.int32, (AUX,), 0)

    def loads(i):
        rows = tuple(_token_rows(i * U + u, k_ref, aux_ref, g_ref) for u in range(U))
        return rows, tuple(dkw_ref[i * U + u].astype(jnp.float32) for u in range(U)), starts_ref[i]

    def body(i, loaded, lam):
        rows, dkws, A = loaded
        prev, states = [], []
        for u in range(U):  # the block's states, recomputed as in the forward
            A_prev, A = _advance(A, rows[u], init_ref, packed)
            prev.append(A_prev)
            states.append(A)
        for u in reversed(range(U)):
            t = i * U + u
            k, aux, g = rows[u]
            doc = column(aux, DOC).astype(jnp.int32)
            if packed:
                lam = lax.cond(column(aux, LAST) != 0, lambda: dfinal_ref[doc], lambda: lam)
            Bt, den = _squash(states[u], k, aux, hyper)
            q = -log_x * dkws[u] * k * Bt / (den * den)
            lam = lam + q / (states[u] + eps)
            alpha = _alpha(aux, g)
            if emit:
                dk_ref[t] = dkws[u] * Bt + 2.0 * column(aux, GAIN) * k * lam
                dg = lam * alpha * prev[u]
                if has_g:
                    out[2][t] = dg
                ddecay = 0.0 if has_g else jnp.sum(dg)
                daux_ref[t] = jnp.where(col == GAIN, jnp.sum(lam * k * k), jnp.where(
                    col == CENTER, -jnp.sum(q), jnp.where(col == DECAY, ddecay, 0.0)))
            lam = alpha * lam
            if packed:
                @pl.when(column(aux, FIRST) != 0)
                def _():
                    dinit_ref[doc] = lam
        return lam

    lam0 = jnp.zeros(k_ref.shape[-1:], jnp.float32) if packed else dfinal_ref[...]
    lam = prefetched_loop(k_ref.shape[0] // U, True, prefetch, loads, body, lam0)
    if not packed:
        dinit_ref[...] = lam


def _specs(T, Kt, num_docs, block_t, packed):
    """BlockSpecs over the grid (b, h, K tile): token rows, aux rows, block starts, states."""
    seq_k = pl.BlockSpec((None, T, None, Kt), lambda b, h, j: (b, 0, h, j))
    seq_aux = pl.BlockSpec((None, T, None, AUX), lambda b, h, j: (b, 0, h, 0))
    starts = pl.BlockSpec((None, T // block_t, None, Kt), lambda b, h, j: (b, 0, h, j))
    if packed:
        state = pl.BlockSpec((num_docs, None, Kt), lambda b, h, j: (0, h, j))
    else:
        state = pl.BlockSpec((None, None, Kt), lambda b, h, j: (b, h, j))
    return seq_k, seq_aux, starts, state


def _pallas(kernel, name, args, in_specs, out_specs, out_shape, grid, num_warps, interpret):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(*args)


def atk_fwd(k, aux, g, initial_state, *, hyper, packed, block_t, block_k, prefetch, num_warps,
            interpret, emit=True):
    """k [B, T, H, K]; aux [B, T, H, AUX] float32; g [B, T, H, K] (per-channel decay) or None;
    initial_state [N, H, K] float32 (N = B unless ``packed``); T a multiple of ``block_t``, K of
    ``block_k``; hyper = (log x, ε). Returns (k̃ in k's dtype, final A [N, H, K], the state
    entering each block of tokens [B, T / block_t, H, K], both float32); without ``emit`` only
    (final A,): the recurrence alone, no squash."""
    B, T, H, K = k.shape
    N = initial_state.shape[0]
    seq_k, seq_aux, starts, state = _specs(T, block_k, N, block_t, packed)
    has_g = g is not None
    kernel = functools.partial(_fwd_kernel, hyper=hyper, packed=packed, block_t=block_t,
                               prefetch=prefetch, has_g=has_g, emit=emit)
    args = [k, aux] + ([g] if has_g else []) + [initial_state]
    in_specs = [seq_k, seq_aux] + ([seq_k] if has_g else []) + [state]
    final = out_struct((N, H, K), jnp.float32, *args)
    if not emit:
        return _pallas(kernel, "atk_fwd_final", args, in_specs, [state], [final],
                       (B, H, K // block_k), num_warps, interpret)
    out_shape = [out_struct(k.shape, k.dtype, *args), final,
                 out_struct((B, T // block_t, H, K), jnp.float32, *args)]
    return _pallas(kernel, "atk_fwd", args, in_specs, [seq_k, state, starts], out_shape,
                   (B, H, K // block_k), num_warps, interpret)


def atk_bwd(k, aux, g, initial_state, starts, dkw, dfinal, *, hyper, packed, block_t, block_k,
            prefetch, num_warps, interpret, emit=True):
    """Cotangents from dk̃ and dfinal, all float32: dk [B, T, H, K]; daux [B, T, H, (K / block_k)
    AUX] (per K tile: the gain, per-head decay and centre columns, to be summed over tiles);
    dg [B, T, H, K] (only with per-channel g); dinit [N, H, K]. ``starts`` from ``atk_fwd``.
    Without ``emit`` only (dinit,): the reverse recurrence alone."""
    B, T, H, K = k.shape
    N = initial_state.shape[0]
    nk = K // block_k
    seq_k, seq_aux, starts_spec, state = _specs(T, block_k, N, block_t, packed)
    daux_spec = pl.BlockSpec((None, T, None, AUX), lambda b, h, j: (b, 0, h, j))
    has_g = g is not None
    kernel = functools.partial(_bwd_kernel, hyper=hyper, packed=packed, block_t=block_t,
                               prefetch=prefetch, has_g=has_g, emit=emit)
    args = [k, aux] + ([g] if has_g else []) + [initial_state, starts, dkw, dfinal]
    in_specs = ([seq_k, seq_aux] + ([seq_k] if has_g else [])
                + [state, starts_spec, seq_k, state])
    f32 = lambda shape: out_struct(shape, jnp.float32, *args)  # noqa: E731
    if not emit:
        return _pallas(kernel, "atk_bwd_initial", args, in_specs, [state], [f32((N, H, K))],
                       (B, H, nk), num_warps, interpret)
    out_shape = [f32(k.shape), f32((B, T, H, nk * AUX))] + ([f32(k.shape)] if has_g else []) + [
        f32((N, H, K))]
    out_specs = [seq_k, daux_spec] + ([seq_k] if has_g else []) + [state]
    return _pallas(kernel, "atk_bwd", args, in_specs, out_specs, out_shape, (B, H, nk),
                   num_warps, interpret)
