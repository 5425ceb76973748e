"""The ATK / PDN A-recurrence and squash (SPEC 3.2) as Mosaic GPU kernels (Hopper), forward
(``atk_fwd``) and reverse (``atk_bwd``), one thread a coordinate (``rows_mosaic``).

The recurrence has no coupling between coordinates: thread j alone walks the tokens of its
(row, head) with A_j in a register, one FMA on its chain a token,

    A_t = α_t A_{t−1} + gain_t s_t       (α_t = exp(g_t) per head, from XLA; s_t = k_t ⊙ k_t)
    ρ_t = log(A_t + ε) − c_h    σ_t = ρ_t / (1 + |ρ_t|)    B_t = exp(−L σ_t)    k̃_t = B_t ⊙ k_t

(L = log x), the squash off the chain. The forward also writes the state entering each tile of
``TILE`` tokens; the reverse kernel recomputes a tile's A_{t−1} rows from it (with exactly the
forward's arithmetic), then walks the tile backwards with λ = ∂L/∂A_t, δ = ∂L/∂k̃_t,
q_t = −L δ k B_t / (1 + |ρ_t|)²:

    Λ_t = λ + q_t / (A_t + ε)     ∂k_t = δ B_t + 2 gain_t k_t Λ_t     λ ← α_t Λ_t
    ∂gain_t = Σ_K Λ_t s_t     ∂c_h −= Σ_K q_t     ∂g_t = α_t Σ_K Λ_t A_{t−1}

the three sums over the coordinates as row sums of padded tiles (Λ_t A_{t−1} in place of A_{t−1}).
Per-channel decays (PKDA) and float32 keys stay on the Triton kernels (``atk_triton``): their
extra [T, 128] float32 tiles do not fit the backward's shared memory. With ``warpgroups=2`` the
chains (A forward, λ in reverse) run on one warpgroup while the other forms and finishes the
neighbouring tiles (the squash, q_t, the row sums, ∂k: ``rows_mosaic.walk_pair``). The wrapper takes these
kernels wherever they run unless ``atk_precond.Options(mosaic=False)``.

Packed documents restart A from the document's initial state at its first token (λ from its
∂final at its last token) through the staging row (``rows_mosaic.restart``), and write the
document's final state (∂initial) where it ends (starts). Padded tokens carry k = 0, gain = 0, α = 1. Rows of
per-token scalars [B, H, 3 (+ 3), Tp]: gain, α, c_h (then document, first, last).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rows_mosaic import (
    F32, K_THREADS, KP, TILE, VEC, check_shape, check_warpgroups, cta_kernel, doc_scratch,
    document_out, issue, padded, restart, row, rows_layout, send, tile, tokens, walk, walk_tiles)
from pallas_kernels.state_mosaic import ROWS
from pallas_kernels.triton_common import out_struct

GAIN, ALPHA, CENTER = 0, 1, 2  # the coefficient rows (then document, first, last)
N_ROWS = 3


def runs(*, K: int, dtype, per_head: bool) -> bool:
    """Whether the kernels take a call: K padded to 128, 16-bit keys, a per-head decay."""
    return K == K_THREADS and jnp.dtype(dtype).itemsize == 2 and per_head


def coefficient_rows(gain, log_decay, center, Tp, docs=None):
    """[B, H, 3 (+ 3), Tp] float32 from gain, log_decay and center [B, T, H]: gain, α =
    exp(log_decay), c_h per token, padded with gain = 0, α = 1; ``docs`` as
    ``rows_mosaic.rows_layout``'s."""
    return rows_layout([gain, jnp.exp(log_decay), center], docs, Tp, ALPHA)


def _advance(A, k_t, gain_t, alpha_t):
    """A_t = α_t A_{t−1} + gain_t (k_t ⊙ k_t): one token of the recurrence (every walk's)."""
    return alpha_t * A + gain_t * (k_t * k_t)


def _coefs_at(c, slot, t):
    """Token t's (gain, α, c_h) from the coefficient rows' buffers ``c`` (c0, c1, c2)."""
    return tuple(c[f"c{j}"][slot, t] for j in range(N_ROWS))


def _squash(A, c, log_x, eps):
    """(B_t, 1 + |ρ_t|) of the state A_t (float32 row) and centre c."""
    rho = jnp.log(A + eps) - c
    den = 1.0 + jnp.abs(rho)
    return jnp.exp(-log_x * (rho / den)), den


def _scratch(k, packed):
    """The coefficient rows' buffers (two slots each) and the key tiles."""
    vec = plgpu.SMEM((2, TILE), F32)
    return dict(k=plgpu.SMEM((2, TILE, K_THREADS), k.dtype),
                **{f"c{j}": vec for j in range(N_ROWS)}, **doc_scratch(packed, vec))


def atk_fwd(k, coefs, initial_state, *, hyper, interpret, packed=False, residuals=False,
            warpgroups=1):
    """k [B, Tp, H, 128] (16-bit; Tp a multiple of TILE), coefs [B, H, 3 (+ 3), Tp]
    (``coefficient_rows``), initial_state [N, H, 128] float32; hyper = (log x, ε). Returns k̃
    [B, Tp, H, 128] in k's dtype and the final A [N, H, 128]; with ``residuals`` also the state
    entering each tile [B, Tp / TILE, H, 128] float32 (``atk_bwd``'s). ``warpgroups`` 2: the
    chain's warpgroup only walks A_t (one FMA a token), writing its rows, while the other
    squashes the rows of the tile before into k̃ and sends them (``rows_mosaic.walk_pair``;
    the same arithmetic, so the same bits)."""
    B, Tp, H, K = k.shape
    check_shape("atk_mosaic.atk_fwd", K, Tp)
    check_warpgroups(warpgroups, k)
    log_x, eps = hyper
    ins = (k, coefs, initial_state)
    out_type = (out_struct((B, Tp, H, K), k.dtype, *ins), out_struct(initial_state.shape, F32, *ins))
    if residuals:
        out_type += (out_struct((B, Tp // TILE, H, K), F32, *ins),)
    scratch = dict(_scratch(k, packed), out=plgpu.SMEM((2, TILE, K), k.dtype),
                   starts=plgpu.SMEM((2, K), F32))
    if warpgroups == 2:  # the A_t rows of the two tiles in flight
        scratch["A"] = plgpu.SMEM((2, TILE, K), F32)
    rows = range(N_ROWS + 3 if packed else N_ROWS)

    def body(k_ref, c_ref, init_ref, out_ref, final_ref, *res_refs, k, out, starts, state,
             start_bar, in_bar, doc_buf, stage, doc=None, first=None, last=None, ready=None,
             done=None, A=None, **c):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = tuple(c[f"c{j}"] for j in range(N_ROWS)) + ((doc, first, last) if packed else ())

        def issue_tile(i, slot):
            issue((b, h), i, slot, in_bar, [(k_ref, k)], rows, c_ref, bufs)

        def coefs_at(slot, t):
            return _coefs_at(c, slot, t)

        def advance(slot, t, k_t, gain_t, alpha_t, A_t):
            """A_t from A_{t−1} (a document's first token: its initial state first)."""
            if packed:
                A_t = restart(A_t, init_ref, h, doc[slot, t], first[slot, t], start_bar, stage)
            A_t = _advance(A_t, k_t, gain_t, alpha_t)
            if packed:  # a document ending here: its final state
                document_out(A_t, final_ref, h, doc[slot, t].astype(jnp.int32), last[slot, t],
                             doc_buf)
            return A_t

        def emit(slot, t, k_t, center_t, A_t):
            out.at[slot, t][...] = (_squash(A_t, center_t, log_x, eps)[0] * k_t).astype(k.dtype)

        def chain(i, slot, A0):  # A_t by rows; with two warpgroups into A's rows, else k̃ too
            starts.at[slot][...] = A0

            def step(t, values, A_t):
                k_t, gain_t, alpha_t, center_t = values
                A_t = advance(slot, t, k_t, gain_t, alpha_t, A_t)
                if warpgroups == 2:
                    A.at[slot, t][...] = A_t
                else:
                    emit(slot, t, k_t, center_t, A_t)
                return A_t

            return tokens(lambda t: (row(k.at[slot, t]),) + coefs_at(slot, t), step, A0,
                          interpret)

        def outputs(i, slot):  # two warpgroups: k̃ from A's rows
            def step(t, values, carry):
                emit(slot, t, *values)
                return carry

            tokens(lambda t: (row(k.at[slot, t]), coefs_at(slot, t)[CENTER], row(A.at[slot, t])),
                   step, None, interpret)

        def store_tile(i, slot):
            send((b, h), i, [(out.at[slot], out_ref)], None, (),
                 [(starts.at[slot], res_refs[0])] if residuals else ())

        walk_tiles(warpgroups, Tp // TILE, False, issue_tile, in_bar, (ready, done), start_bar,
                   state, init_ref.at[0 if packed else b, h],
                   None if packed else final_ref.at[b, h], lambda i, slot: None, chain,
                   outputs if warpgroups == 2 else lambda i, slot: None, store_tile)

    return cta_kernel(body, "atk_fwd_mosaic", out_type, scratch, B, H, interpret, ins,
                      len(rows) + 1, warpgroups)


def _pullback(k_t, delta, A_prev, gain_t, alpha_t, center_t, log_x, eps):
    """(s_t, A_t, B_t, q_t) of token t from its key, ∂k̃_t = δ and A_{t−1} (module docstring)."""
    s_t = k_t * k_t
    A = _advance(A_prev, k_t, gain_t, alpha_t)
    B_t, den = _squash(A, center_t, log_x, eps)
    return s_t, A, B_t, -log_x * delta * k_t * B_t / (den * den)


def atk_bwd(k, dkw, coefs, starts, init, dfinal, *, hyper, interpret, packed=False,
            warpgroups=1):
    """The reverse recurrence (module docstring), tiles in reverse, each tile's A_{t−1}
    recomputed from ``starts`` [B, Tp / TILE, H, 128]. k, ∂k̃ [B, Tp, H, 128] (16-bit), coefs
    as ``atk_fwd``'s, init (the documents' initial states; read with ``packed`` only) and dfinal
    [N, H, 128]. Returns (∂k [B, Tp, H, 128] in k's dtype, rows (∂gain, −Σ q, ∂g) [B, H, 3, Tp]
    float32, ∂initial [N, H, 128]). ``warpgroups`` 2: ``_pair_bwd``."""
    B, Tp, H, K = k.shape
    check_shape("atk_mosaic.atk_bwd", K, Tp)
    check_warpgroups(warpgroups, k, dkw)
    log_x, eps = hyper
    ins = (k, dkw, coefs, starts, init, dfinal)
    out_type = (out_struct((B, Tp, H, K), k.dtype, *ins), out_struct((B, H, 3, Tp), F32, *ins),
                out_struct(dfinal.shape, F32, *ins))
    if warpgroups == 2:
        if dkw.dtype != k.dtype:  # ∂k leaves from ∂k̃'s tile
            raise ValueError(f"warpgroups=2 takes ∂k̃ in k's dtype, got {dkw.dtype} and {k.dtype}")
        return _pair_bwd(ins, out_type, hyper=hyper, interpret=interpret, packed=packed)
    scratch = dict(_scratch(k, packed), dkw=plgpu.SMEM((2, TILE, K), dkw.dtype),
                   st=plgpu.SMEM((2, K), F32), prev=plgpu.SMEM((TILE, KP), F32),
                   dk=plgpu.SMEM((TILE, K), k.dtype), P1=plgpu.SMEM((TILE, KP), F32),
                   P2=plgpu.SMEM((TILE, KP), F32), sums=plgpu.SMEM((3, 2, TILE), F32))
    rows = range(N_ROWS + 3 if packed else N_ROWS)

    def body(k_ref, dkw_ref, c_ref, st_ref, init_ref, dfinal_ref, dk_ref, rows_ref, dinit_ref,
             *, k, dkw, st, prev, dk, P1, P2, sums, state, start_bar, in_bar, doc_buf, stage,
             doc=None, first=None, last=None, **c):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = tuple(c[f"c{j}"] for j in range(N_ROWS)) + ((doc, first, last) if packed else ())
        prev, P1, P2 = padded(prev), padded(P1), padded(P2)

        def issue_tile(i, slot):
            issue((b, h), i, slot, in_bar, [(k_ref, k), (dkw_ref, dkw)], rows, c_ref, bufs,
                  [(st_ref, st)])

        def run_tile(i, slot, lam0):
            gain, alpha, center = (c[f"c{j}"].at[slot] for j in range(N_ROWS))

            def recompute(t, values, A):  # A_{t−1} into ``prev``, as the forward walks
                k_t, g_t, a_t = values
                if packed:
                    A = restart(A, init_ref, h, doc[slot, t], first[slot, t], start_bar, stage)
                prev.at[t][...] = A
                return _advance(A, k_t, g_t, a_t)

            tokens(lambda t: (row(k.at[slot, t]), gain[t], alpha[t]), recompute,
                   plgpu.load(st.at[slot], layout=VEC), interpret)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's ∂k was sent
            plgpu.commit_smem()  # (every thread waits for the one that waited)

            def load(t):
                k_t, delta, A_prev = row(k.at[slot, t]), row(dkw.at[slot, t]), row(prev.at[t])
                g_t, a_t = gain[t], alpha[t]
                s_t, A, B_t, q = _pullback(k_t, delta, A_prev, g_t, a_t, center[t], log_x, eps)
                return k_t, delta, A_prev, g_t, a_t, s_t, B_t, q, q / (A + eps)

            def step(t, values, lam):
                k_t, delta, A_prev, g_t, a_t, s_t, B_t, q, e = values
                if packed:
                    lam = restart(lam, dfinal_ref, h, doc[slot, t], last[slot, t], start_bar,
                                   stage)
                big = lam + e
                dk.at[t][...] = (delta * B_t + 2.0 * g_t * k_t * big).astype(k.dtype)
                P1.at[t][...] = big * s_t
                P2.at[t][...] = q
                prev.at[t][...] = big * A_prev  # (in place: read by this thread's loads)
                lam = a_t * big
                if packed:  # a document starting here: ∂ of its initial state
                    document_out(lam, dinit_ref, h, doc[slot, t].astype(jnp.int32), first[slot, t],
                                 doc_buf)
                return lam

            lam = tokens(load, step, lam0, interpret, reverse=True)
            plgpu.commit_smem()
            alpha_row = plgpu.load(alpha, layout=ROWS)
            sums.at[0, slot][...] = jnp.sum(tile(P1, interpret), axis=1)
            sums.at[1, slot][...] = -jnp.sum(tile(P2, interpret), axis=1)
            sums.at[2, slot][...] = alpha_row * jnp.sum(tile(prev, interpret), axis=1)
            return lam

        def store_tile(i, slot):
            send((b, h), i, [(dk, dk_ref)], rows_ref, tuple(sums.at[j, slot] for j in range(3)))

        walk(Tp // TILE, True, issue_tile, in_bar, start_bar, state,
             dfinal_ref.at[0 if packed else b, h], None if packed else dinit_ref.at[b, h],
             run_tile, store_tile)

    return cta_kernel(body, "atk_bwd_mosaic", out_type, scratch, B, H, interpret, ins,
                      len(rows) + 3)


def _pair_bwd(ins, out_type, *, hyper, interpret, packed):
    """``atk_bwd`` on two warpgroups (``rows_mosaic.walk_pair``, tiles in reverse), with the
    one-warpgroup kernel's arithmetic (tests/test_pallas_atk_pair.py: where interpret mode
    differs). Warpgroup 1 forms a tile: its A_{t−1}
    rows (``prev``, by a forward walk from the state entering it), q_t by rows into ``Q`` and
    the row sums −Σ q; warpgroup 0 walks λ back through it, Λ_t = λ + q_t / (A_t + ε) written
    over q_t's row, λ ← α_t Λ_t; warpgroup 1 then finishes it: the row sums Σ Λ s and α Σ Λ
    A_{t−1} of the whole tile, and ∂k_t = δ B_t + 2 gain_t k_t Λ_t by rows (B_t formed again
    from A_{t−1}) over ∂k̃'s tile, sent as one copy."""
    k, dkw, coefs, starts, init, dfinal = ins
    B, Tp, H, K = k.shape
    log_x, eps = hyper
    scratch = dict(_scratch(k, packed), dkw=plgpu.SMEM((2, TILE, K), dkw.dtype),
                   st=plgpu.SMEM((2, K), F32), prev=plgpu.SMEM((2, TILE, KP), F32),
                   Q=plgpu.SMEM((2, TILE, KP), F32), sums=plgpu.SMEM((3, 2, TILE), F32))
    if packed:  # warpgroup 1's own restart rows
        scratch.update(form_bar=plgpu.Barrier(), form_stage=plgpu.SMEM((K,), F32))
    rows = range(N_ROWS + 3 if packed else N_ROWS)

    def body(k_ref, dkw_ref, c_ref, st_ref, init_ref, dfinal_ref, dk_ref, rows_ref, dinit_ref,
             *, k, dkw, st, prev, Q, sums, state, start_bar, in_bar, doc_buf, stage, ready, done,
             doc=None, first=None, last=None, form_bar=None, form_stage=None, **c):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        bufs = tuple(c[f"c{j}"] for j in range(N_ROWS)) + ((doc, first, last) if packed else ())

        def issue_tile(i, slot):
            issue((b, h), i, slot, in_bar, [(k_ref, k), (dkw_ref, dkw)], rows, c_ref, bufs,
                  [(st_ref, st)])

        def coefs_at(slot, t):
            return _coefs_at(c, slot, t)

        def terms(slot, t):
            A_prev = row(padded(prev.at[slot]).at[t])
            return (row(k.at[slot, t]), row(dkw.at[slot, t]), A_prev, *coefs_at(slot, t))

        def form(i, slot):  # A_{t−1} into prev, q_t into Q, −Σ q
            P, Qs = padded(prev.at[slot]), padded(Q.at[slot])

            def recompute(t, values, A):
                k_t, g_t, a_t = values
                if packed:
                    A = restart(A, init_ref, h, doc[slot, t], first[slot, t], form_bar,
                                form_stage)
                P.at[t][...] = A
                return _advance(A, k_t, g_t, a_t)

            with jax.named_scope("recompute"):
                tokens(lambda t: (row(k.at[slot, t]),) + coefs_at(slot, t)[:2], recompute,
                       plgpu.load(st.at[slot], layout=VEC), interpret)
            plgpu.commit_smem()

            def q_row(t, values, carry):
                Qs.at[t][...] = _pullback(*values, log_x, eps)[3]
                return carry

            with jax.named_scope("q"):
                tokens(lambda t: terms(slot, t), q_row, None, interpret)
                plgpu.commit_smem()
                sums.at[1, slot][...] = -jnp.sum(tile(Qs, interpret), axis=1)

        def chain(i, slot, lam0):  # Λ_t over q_t; λ before the tile
            Qs = padded(Q.at[slot])

            def load(t):
                k_t, A_prev, q = (row(x.at[t]) for x in (k.at[slot], padded(prev.at[slot]), Qs))
                g_t, a_t, _ = coefs_at(slot, t)
                A = _advance(A_prev, k_t, g_t, a_t)
                return a_t, q / (A + eps)

            def step(t, values, lam):
                a_t, e = values
                if packed:
                    lam = restart(lam, dfinal_ref, h, doc[slot, t], last[slot, t], start_bar,
                                   stage)
                big = lam + e
                Qs.at[t][...] = big
                lam = a_t * big
                if packed:  # a document starting here: ∂ of its initial state
                    document_out(lam, dinit_ref, h, doc[slot, t].astype(jnp.int32),
                                 first[slot, t], doc_buf)
                return lam

            return tokens(load, step, lam0, interpret, reverse=True)

        def outputs(i, slot):  # Σ Λ s, α Σ Λ A_{t−1}; ∂k over ∂k̃
            P, Qs = padded(prev.at[slot]), padded(Q.at[slot])
            with jax.named_scope("sums"):
                big = tile(Qs, interpret)
                k_tile = tile(k.at[slot], interpret)
                sums.at[0, slot][...] = jnp.sum(big * (k_tile * k_tile), axis=1)
                alpha_row = plgpu.load(c[f"c{ALPHA}"].at[slot], layout=ROWS)
                sums.at[2, slot][...] = alpha_row * jnp.sum(big * tile(P, interpret), axis=1)

            def dk_row(t, values, carry):
                k_t, delta, A_prev, g_t, a_t, c_t, big_t = values
                B_t = _squash(_advance(A_prev, k_t, g_t, a_t), c_t, log_x, eps)[0]
                dkw.at[slot, t][...] = (delta * B_t + 2.0 * g_t * k_t * big_t).astype(dkw.dtype)
                return carry

            with jax.named_scope("dk"):
                tokens(lambda t: terms(slot, t) + (row(Qs.at[t]),), dk_row, None, interpret)

        def store_tile(i, slot):
            send((b, h), i, [(dkw.at[slot], dk_ref)], rows_ref,
                 tuple(sums.at[j, slot] for j in range(3)))

        walk_tiles(2, Tp // TILE, True, issue_tile, in_bar, (ready, done), start_bar, state,
                   dfinal_ref.at[0 if packed else b, h], None if packed else dinit_ref.at[b, h],
                   form, chain, outputs, store_tile)

    return cta_kernel(body, "atk_bwd_mosaic", out_type, scratch, B, H, interpret, ins,
                      len(rows) + 3, 2)
