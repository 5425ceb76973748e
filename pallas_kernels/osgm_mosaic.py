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
K_THREADS = 128  # the head dim the kernel takes: one coordinate a thread of a warpgroup
TILE = 64  # tokens a TMA tile
W, G, R = range(3)  # rows of the coefficients [B, H, 3, Tp]
VEC = plgpu.Layout.WG_STRIDED((K_THREADS,), vec_size=1)


def coefficient_rows(k, beta, retention, eta, beta_aware, eps, Tp):
    """[B, H, 3, Tp] float32: w = η g / max(Σ k², ε), g = β (beta-aware) or 1, r (1 without
    retention) per token, padded to Tp tokens with w = 0, g = 0, r = 1."""
    B, T, H, _ = k.shape
    kf = k.astype(F32)
    n = jnp.maximum(jnp.sum(kf * kf, -1), eps)
    g = beta.astype(F32) if beta_aware else jnp.ones((B, T, H), F32)
    r = jnp.ones((B, T, H), F32) if retention is None else jnp.broadcast_to(
        retention.astype(F32), (B, T, H))
    rows = jnp.stack([eta * g / n, g, r], axis=1)  # [B, 3, T, H]
    rows = jnp.pad(rows, [(0, 0), (0, 0), (0, Tp - T), (0, 0)])
    rows = rows.at[:, R, T:].set(1.0)
    return jnp.transpose(rows, (0, 3, 1, 2))


def osgm_fwd(k, coefs, initial_state, *, bounds, emit_d, interpret):
    """k [B, Tp, H, 128] (Tp a multiple of TILE), coefs [B, H, 3, Tp] (``coefficient_rows``),
    initial_state [B, H, 128] float32; bounds (d_min, d_max). Returns (k̃ [B, Tp, H, 128] in k's
    dtype, or every d_t float32 if ``emit_d``; final d [B, H, 128] float32)."""
    B, Tp, H, K = k.shape
    if K != K_THREADS or Tp % TILE:
        raise ValueError(f"osgm_mosaic.osgm_fwd takes K = {K_THREADS} and T a multiple of "
                         f"{TILE}, got K={K}, T={Tp}")
    d_min, d_max = bounds
    out_dtype = F32 if emit_d else k.dtype
    ins = (k, coefs, initial_state)
    out_type = (out_struct((B, Tp, H, K), out_dtype, *ins), out_struct((B, H, K), F32, *ins))
    vec = plgpu.SMEM((2, TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, TILE, K), k.dtype), w=vec, g=vec, r=vec,
                   out=plgpu.SMEM((2, TILE, K), out_dtype), state=plgpu.SMEM((K,), F32),
                   bar=plgpu.Barrier(num_arrivals=4, num_barriers=2),
                   init_bar=plgpu.Barrier())
    n_tiles = Tp // TILE

    def body(k_ref, c_ref, init_ref, out_ref, final_ref, *, k, w, g, r, out, state, bar,
             init_bar):
        b, h = lax.axis_index("b"), lax.axis_index("h")

        def issue(i, slot):
            rows = pl.ds(i * TILE, TILE)
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k.at[slot], bar.at[slot])
            for row, buf in ((W, w), (G, g), (R, r)):
                plgpu.copy_gmem_to_smem(c_ref.at[b, h, row, rows], buf.at[slot], bar.at[slot])

        issue(0, 0)
        plgpu.copy_gmem_to_smem(init_ref.at[b, h], state, init_bar)
        plgpu.barrier_wait(init_bar)
        d0 = plgpu.load(state, layout=VEC)

        def tile(i, d):
            slot = lax.rem(i, 2)
            plgpu.barrier_wait(bar.at[slot])

            @pl.when(i + 1 < n_tiles)
            def _next():
                issue(i + 1, 1 - slot)

            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # tile i - 2's outputs were sent

            def token(t, d):
                k_t = plgpu.load(k.at[slot, t], layout=VEC).astype(F32)
                s = k_t * k_t
                a = jnp.sum(d * s)
                out.at[slot, t][...] = d if emit_d else (d * k_t).astype(out_dtype)
                u = w[slot, t] * (1.0 - g[slot, t] * a)
                p = r[slot, t] * d + u * s
                return jnp.where(p >= d_max, d_max, jnp.where(p <= d_min, d_min, p))

            d = lax.fori_loop(0, TILE, token, d, unroll=8)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out.at[slot], out_ref.at[b, pl.ds(i * TILE, TILE), h])
            return d

        d = lax.fori_loop(0, n_tiles, tile, d0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        state[...] = d
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state, final_ref.at[b, h])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, H), grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="osgm_fwd_mosaic")(k, coefs, initial_state)


def runs(*, K: int, packed: bool) -> bool:
    """Whether ``osgm_fwd`` takes a call: dense rows and a head dim padded to 128."""
    return not packed and K == K_THREADS


U, RB, GW, GN = range(4)  # rows of the backward's coefficients [B, H, 4, Tp]
BWD_TILE = 32  # the backward's tiles (six of them fit 227 KB of shared memory with f32 keys)


def backward_rows(k, d, beta, retention, eta, beta_aware, eps, Tp):
    """[B, H, 4, Tp] float32 per token from the forward's d_t: u = w (1 − g a), r, w g and
    [Σ s > ε] (1 − g a) w / n̄ (a = ⟨d_t, s_t⟩; padded with zeros but r = 1: with d padded
    strictly inside the box, a padded token passes λ on unchanged), and a [B, T, H]."""
    B, T, H, _ = k.shape
    kf = k.astype(F32)
    s = kf * kf
    ss = jnp.sum(s, -1)
    n = jnp.maximum(ss, eps)
    g = beta.astype(F32) if beta_aware else jnp.ones((B, T, H), F32)
    r = jnp.ones((B, T, H), F32) if retention is None else jnp.broadcast_to(
        retention.astype(F32), (B, T, H))
    w, a = eta * g / n, jnp.sum(d * s, -1)
    v = 1.0 - g * a
    rows = jnp.stack([w * v, r, w * g, jnp.where(ss > eps, v * w / n, 0.0)], axis=1)
    rows = jnp.pad(rows, [(0, 0), (0, 0), (0, Tp - T), (0, 0)])
    rows = rows.at[:, RB, T:].set(1.0)
    return jnp.transpose(rows, (0, 3, 1, 2)), a


def osgm_bwd(k, d, dkw, coefs, dfinal, *, bounds, interpret):
    """The reverse token loop (``osgm_triton``'s backward, one coordinate a thread, tiles in
    reverse): with λ = ∂L/∂d_{t+1}, μ = λ ⊙ [d_min < r d + u s < d_max] and γ = ⟨μ, s⟩,

        ∂k_t = 2 k (u μ − γ (w g) d − γ c_n) + ∂k̃ ⊙ d      ∂r_t = ⟨μ, d⟩
        λ ← r μ − γ (w g) s + ∂k̃ ⊙ k

    from k, d (every d_t, float32) and ∂k̃ [B, Tp, H, 128], coefs [B, H, 4, Tp]
    (``backward_rows``) and dfinal [B, H, 128]. Returns (∂k [B, Tp, H, 128] float32, rows
    (γ, ∂r) [B, H, 2, Tp] float32, ∂d_1 [B, H, 128])."""
    B, Tp, H, K = k.shape
    if K != K_THREADS or Tp % TILE:
        raise ValueError(f"osgm_mosaic.osgm_bwd takes K = {K_THREADS} and T a multiple of "
                         f"{TILE}, got K={K}, T={Tp}")
    d_min, d_max = bounds
    ins = (k, d, dkw, coefs, dfinal)
    out_type = (out_struct((B, Tp, H, K), F32, *ins), out_struct((B, H, 2, Tp), F32, *ins),
                out_struct((B, H, K), F32, *ins))
    vec = plgpu.SMEM((2, BWD_TILE), F32)
    scratch = dict(k=plgpu.SMEM((2, BWD_TILE, K), k.dtype), d=plgpu.SMEM((2, BWD_TILE, K), F32),
                   dkw=plgpu.SMEM((2, BWD_TILE, K), dkw.dtype), u=vec, r=vec, gw=vec, gn=vec,
                   dk=plgpu.SMEM((2, BWD_TILE, K), F32), gam=vec, dr=vec, state=plgpu.SMEM((K,), F32),
                   bar=plgpu.Barrier(num_arrivals=7, num_barriers=2), init_bar=plgpu.Barrier())
    n_tiles = Tp // BWD_TILE

    def body(k_ref, d_ref, dkw_ref, c_ref, dfinal_ref, dk_ref, rows_ref, dinit_ref, *, k, d,
             dkw, u, r, gw, gn, dk, gam, dr, state, bar, init_bar):
        b, h = lax.axis_index("b"), lax.axis_index("h")

        def issue(i, slot):
            rows = pl.ds(i * BWD_TILE, BWD_TILE)
            for src, dst in ((k_ref, k), (d_ref, d), (dkw_ref, dkw)):
                plgpu.copy_gmem_to_smem(src.at[b, rows, h], dst.at[slot], bar.at[slot])
            for row, buf in ((U, u), (RB, r), (GW, gw), (GN, gn)):
                plgpu.copy_gmem_to_smem(c_ref.at[b, h, row, rows], buf.at[slot], bar.at[slot])

        issue(n_tiles - 1, 0)
        plgpu.copy_gmem_to_smem(dfinal_ref.at[b, h], state, init_bar)
        plgpu.barrier_wait(init_bar)
        lam0 = plgpu.load(state, layout=VEC)

        def tile(j, lam):
            i, slot = n_tiles - 1 - j, lax.rem(j, 2)
            plgpu.barrier_wait(bar.at[slot])

            @pl.when(j + 1 < n_tiles)
            def _next():
                issue(i - 1, 1 - slot)

            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # tile i + 2's outputs were sent

            def token(tt, lam):
                t = BWD_TILE - 1 - tt
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

            lam = lax.fori_loop(0, BWD_TILE, token, lam, unroll=8)
            plgpu.commit_smem()
            rows = pl.ds(i * BWD_TILE, BWD_TILE)
            plgpu.copy_smem_to_gmem(dk.at[slot], dk_ref.at[b, rows, h], commit_group=False)
            plgpu.copy_smem_to_gmem(gam.at[slot], rows_ref.at[b, h, 0, rows], commit_group=False)
            plgpu.copy_smem_to_gmem(dr.at[slot], rows_ref.at[b, h, 1, rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            return lam

        lam = lax.fori_loop(0, n_tiles, tile, lam0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        state[...] = lam
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state, dinit_ref.at[b, h])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, H), grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="osgm_bwd_mosaic")(k, d, dkw, coefs, dfinal)
