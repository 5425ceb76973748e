"""The OSGM / OSDN d scan's token loops (SPEC 3.1) as Mosaic GPU kernels (Hopper): the forward
(below) and the reverse one (``osgm_bwd``).

One CTA a (batch row, head), one warpgroup, each of its 128 threads one coordinate of d
(float32, a register): per token, with s = k ⊙ k and the per-token coefficients w = η g / n̄,
g (β or 1) and r from XLA,

    a = ⟨d, s⟩ (a warpgroup reduction)     u = w (1 − g a)
    out_t = d ⊙ k (or d itself)           d ← clip(r d + u s, d_min, d_max)

the arithmetic of ``osgm_triton``'s forward (its Σ s and the division too, in XLA here). The
keys and coefficients arrive by TMA in tiles of ``TILE`` tokens, double-buffered (the next
tile's loads fly during this one's loop), and the outputs leave by TMA from double-buffered
tiles: no global load or store waits on the per-token chain, whose length is one reduction,
two scalar operations and the update (``osgm_triton``'s one-warp programs load each token's
rows from global memory inside the loop). Dense rows only (T padded to a whole tile: k = 0, w = 0,
r = 1 leave d as it is); K = 128 (one coordinate a thread). In interpret mode
(``plgpu.InterpretGPUParams``) the same program runs on the CPU.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.triton_common import out_struct

F32 = jnp.float32
K_THREADS = 128  # the head dim the kernels take: one coordinate a thread of a warpgroup
TILE = 64  # tokens a TMA tile of the forward; T is padded to a multiple of it
BWD_TILE = 32  # the backward's (six tiles of 32 fit 227 KB of shared memory with f32 keys)
W, G, R = range(3)  # rows of the forward's coefficients [B, H, 3, Tp]
U, RB, GW, GN = range(4)  # rows of the backward's [B, H, 4, Tp]
VEC = plgpu.Layout.WG_STRIDED((K_THREADS,), vec_size=1)


def runs(*, K: int, packed: bool) -> bool:
    """Whether the kernels take a call: dense rows and a head dim padded to 128."""
    return not packed and K == K_THREADS


def _per_token(k, beta, retention, eta, beta_aware, eps):
    """(s = k ⊙ k, Σ s, n̄ = max(Σ s, ε), g = β or 1, r, w = η g / n̄), float32 [B, T, H(, K)]."""
    B, T, H, _ = k.shape
    kf = k.astype(F32)
    s = kf * kf
    ss = jnp.sum(s, -1)
    n = jnp.maximum(ss, eps)
    g = beta.astype(F32) if beta_aware else jnp.ones((B, T, H), F32)
    r = jnp.ones((B, T, H), F32) if retention is None else jnp.broadcast_to(
        retention.astype(F32), (B, T, H))
    return s, ss, n, g, r, eta * g / n


def _rows(rows, Tp, ones):
    """Per-token rows [B, T, H] each as [B, H, len(rows), Tp] float32, padded with zeros but
    row ``ones`` with ones."""
    T = rows[0].shape[1]
    x = jnp.pad(jnp.stack(rows, axis=1), [(0, 0), (0, 0), (0, Tp - T), (0, 0)])
    return jnp.transpose(x.at[:, ones, T:].set(1.0), (0, 3, 1, 2))


def coefficient_rows(k, beta, retention, eta, beta_aware, eps, Tp):
    """The forward's [B, H, 3, Tp]: w = η g / max(Σ k², ε), g = β (beta-aware) or 1, r (1
    without retention) per token, padded to Tp tokens with w = 0, g = 0, r = 1."""
    _, _, _, g, r, w = _per_token(k, beta, retention, eta, beta_aware, eps)
    return _rows([w, g, r], Tp, R)


def backward_rows(k, d, beta, retention, eta, beta_aware, eps, Tp):
    """The backward's [B, H, 4, Tp] from the forward's d_t: u = w (1 − g a), r, w g and
    [Σ s > ε] (1 − g a) w / n̄ (a = ⟨d_t, s_t⟩; padded with zeros but r = 1: with d padded
    strictly inside the box, a padded token passes λ on unchanged), and a [B, T, H]."""
    s, ss, n, g, r, w = _per_token(k, beta, retention, eta, beta_aware, eps)
    a = jnp.sum(d * s, -1)
    v = 1.0 - g * a
    return _rows([w * v, r, w * g, jnp.where(ss > eps, v * w / n, 0.0)], Tp, RB), a


def _check(name, K, Tp):
    if K != K_THREADS or Tp % TILE:
        raise ValueError(f"osgm_mosaic.{name} takes K = {K_THREADS} and T a multiple of {TILE}, "
                         f"got K={K}, T={Tp}")


def _walk(n_tiles, reverse, issue, in_bar, start_bar, state, start, end, run_tile,
          store_tile):
    """The tile loop of a CTA: ``n_tiles`` tiles in order (descending if ``reverse``),
    double-buffered (slot j % 2 for the j-th walked; ``issue(i, slot)`` sends tile i's copies
    to ``in_bar[slot]``, the next tile's right after this one's arrived), the carry (one
    coordinate a thread) from the GMEM ref ``start`` (by ``start_bar``) through ``state`` to
    ``end``;
    ``run_tile(i, slot, carry)`` returns the next carry after writing the tile's outputs into
    slot ``slot``, which ``store_tile(i, slot)`` sends (one commit group a tile: the slot is
    reused once the group of two tiles before has been read)."""
    at = (lambda j: n_tiles - 1 - j) if reverse else (lambda j: j)
    issue(at(0), 0)
    plgpu.copy_gmem_to_smem(start, state, start_bar)
    plgpu.barrier_wait(start_bar)

    def body(j, carry):
        i, slot = at(j), lax.rem(j, 2)
        plgpu.barrier_wait(in_bar.at[slot])

        @pl.when(j + 1 < n_tiles)
        def _next():
            issue(at(j + 1), 1 - slot)

        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's last outputs were sent
        carry = run_tile(i, slot, carry)
        plgpu.commit_smem()
        store_tile(i, slot)
        return carry

    carry = lax.fori_loop(0, n_tiles, body, plgpu.load(state, layout=VEC))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    state[...] = carry
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(state, end)
    plgpu.wait_smem_to_gmem(0)


def _kernel(body, name, out_type, scratch, B, H, interpret, args, arrivals):
    """One CTA a (row, head) with ``scratch`` plus the state buffer and the barriers (two tile
    slots of ``arrivals`` copies, one for the carry's start)."""
    scratch = dict(scratch, state=plgpu.SMEM((K_THREADS,), F32), start_bar=plgpu.Barrier(),
                   in_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=2))
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, H), grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)(*args)


def _clip(p, d_min, d_max):
    """``reference.osgm.clip_box``'s values."""
    return jnp.where(p >= d_max, d_max, jnp.where(p <= d_min, d_min, p))


def osgm_fwd(k, coefs, initial_state, *, bounds, emit_d, interpret):
    """k [B, Tp, H, 128] (Tp a multiple of TILE), coefs [B, H, 3, Tp] (``coefficient_rows``),
    initial_state [B, H, 128] float32; bounds (d_min, d_max). Returns (k̃ [B, Tp, H, 128] in k's
    dtype, or every d_t float32 if ``emit_d``; final d [B, H, 128] float32)."""
    B, Tp, H, K = k.shape
    _check("osgm_fwd", K, Tp)
    d_min, d_max = bounds
    out_dtype = F32 if emit_d else k.dtype
    ins = (k, coefs, initial_state)
    out_type = (out_struct((B, Tp, H, K), out_dtype, *ins), out_struct((B, H, K), F32, *ins))
    vec = plgpu.SMEM((2, TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, TILE, K), k.dtype), w=vec, g=vec, r=vec,
                   out=plgpu.SMEM((2, TILE, K), out_dtype))

    def body(k_ref, c_ref, init_ref, out_ref, final_ref, *, k, w, g, r, out, state, start_bar,
             in_bar):
        b, h = lax.axis_index("b"), lax.axis_index("h")

        def issue(i, slot):
            rows = pl.ds(i * TILE, TILE)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k.at[slot], in_bar.at[slot])
            for row, buf in ((W, w), (G, g), (R, r)):
                plgpu.copy_gmem_to_smem(c_ref.at[b, h, row, rows], buf.at[slot], in_bar.at[slot])

        def run_tile(i, slot, d):
            def token(t, d):
                k_t = plgpu.load(k.at[slot, t], layout=VEC).astype(F32)
                s = k_t * k_t
                a = jnp.sum(d * s)
                out.at[slot, t][...] = d if emit_d else (d * k_t).astype(out_dtype)
                u = w[slot, t] * (1.0 - g[slot, t] * a)
                return _clip(r[slot, t] * d + u * s, d_min, d_max)

            return lax.fori_loop(0, TILE, token, d, unroll=8)

        def store_tile(i, slot):
            plgpu.copy_smem_to_gmem(out.at[slot], out_ref.at[b, pl.ds(i * TILE, TILE), h])

        _walk(Tp // TILE, False, issue, in_bar, start_bar, state, init_ref.at[b, h],
              final_ref.at[b, h], run_tile, store_tile)

    return _kernel(body, "osgm_fwd_mosaic", out_type, scratch, B, H, interpret, ins, 4)


def osgm_bwd(k, d, dkw, coefs, dfinal, *, bounds, interpret):
    """The reverse token loop (``osgm_triton``'s backward, one coordinate a thread, tiles in
    reverse): with λ = ∂L/∂d_{t+1}, μ = λ ⊙ [d_min < r d + u s < d_max] and γ = ⟨μ, s⟩,

        ∂k_t = 2 k (u μ − γ (w g) d − γ c_n) + ∂k̃ ⊙ d      ∂r_t = ⟨μ, d⟩
        λ ← r μ − γ (w g) s + ∂k̃ ⊙ k

    from k, d (every d_t, float32) and ∂k̃ [B, Tp, H, 128], coefs [B, H, 4, Tp]
    (``backward_rows``) and dfinal [B, H, 128]. Returns (∂k [B, Tp, H, 128] float32, rows
    (γ, ∂r) [B, H, 2, Tp] float32, ∂d_1 [B, H, 128])."""
    B, Tp, H, K = k.shape
    _check("osgm_bwd", K, Tp)
    d_min, d_max = bounds
    ins = (k, d, dkw, coefs, dfinal)
    out_type = (out_struct((B, Tp, H, K), F32, *ins), out_struct((B, H, 2, Tp), F32, *ins),
                out_struct((B, H, K), F32, *ins))
    vec, n = plgpu.SMEM((2, BWD_TILE), F32), BWD_TILE
    scratch = dict(k=plgpu.SMEM((2, n, K), k.dtype), d=plgpu.SMEM((2, n, K), F32),
                   dkw=plgpu.SMEM((2, n, K), dkw.dtype), u=vec, r=vec, gw=vec, gn=vec,
                   dk=plgpu.SMEM((2, n, K), F32), gam=vec, dr=vec)

    def body(k_ref, d_ref, dkw_ref, c_ref, dfinal_ref, dk_ref, rows_ref, dinit_ref, *, k, d,
             dkw, u, r, gw, gn, dk, gam, dr, state, start_bar, in_bar):
        b, h = lax.axis_index("b"), lax.axis_index("h")

        def issue(i, slot):
            rows = pl.ds(i * n, n)
            for src, dst in ((k_ref, k), (d_ref, d), (dkw_ref, dkw)):
                plgpu.copy_gmem_to_smem(src.at[b, rows, h], dst.at[slot], in_bar.at[slot])
            for row, buf in ((U, u), (RB, r), (GW, gw), (GN, gn)):
                plgpu.copy_gmem_to_smem(c_ref.at[b, h, row, rows], buf.at[slot], in_bar.at[slot])

        def run_tile(i, slot, lam):
            def token(tt, lam):
                t = n - 1 - tt
                k_t = plgpu.load(k.at[slot, t], layout=VEC).astype(F32)
                d_t = plgpu.load(d.at[slot, t], layout=VEC)
                dkw_t = plgpu.load(dkw.at[slot, t], layout=VEC).astype(F32)
                s = k_t * k_t
                u_t, r_t = u[slot, t], r[slot, t]
                p = r_t * d_t + u_t * s
                mu = jnp.where((p > d_min) & (p < d_max), lam, 0.0)
                gu = jnp.sum(mu * s)
                ga, g_n = -gu * gw[slot, t], -gu * gn[slot, t]
                dk.at[slot, t][...] = 2.0 * k_t * (u_t * mu + ga * d_t + g_n) + dkw_t * d_t
                gam[slot, t] = gu
                dr[slot, t] = jnp.sum(mu * d_t)
                return r_t * mu + ga * s + dkw_t * k_t

            return lax.fori_loop(0, n, token, lam, unroll=8)

        def store_tile(i, slot):
            rows = pl.ds(i * n, n)
            plgpu.copy_smem_to_gmem(dk.at[slot], dk_ref.at[b, rows, h], commit_group=False)
            plgpu.copy_smem_to_gmem(gam.at[slot], rows_ref.at[b, h, 0, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(dr.at[slot], rows_ref.at[b, h, 1, rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        _walk(Tp // n, True, issue, in_bar, start_bar, state, dfinal_ref.at[b, h],
              dinit_ref.at[b, h], run_tile, store_tile)

    return _kernel(body, "osgm_bwd_mosaic", out_type, scratch, B, H, interpret, ins, 7)
