"""``osgm_precondition`` (SPEC 3.1) on Pallas kernels: layout, ``custom_vjp`` wrapper, ``supports``.

Forward: the token loop of ``osgm_triton`` (one program per batch row and head, d in registers,
exact clip, no host synchronisation), or with ``Options.mosaic_loops`` the Mosaic GPU kernels of
``osgm_mosaic`` (both directions, their own residuals) where they run. Backward (exact): under
differentiation the forward kernel writes every d_t (float32, kept as the residual; k̃ = d ⊙ k
is formed from it), then the reverse kernel propagates λ = ∂L/∂d through the clipped recurrence
and emits the cotangents of k, β, r and the initial state. The clip's derivative is that of
``reference.osgm.clip_box`` (0 on and beyond a bound). With ``Options.picard_iters`` (chosen by
shape by default) each way first runs Picard sweeps (``osgm_sweep_triton``); the token-loop
kernels then run only for the sequences whose sweeps did not settle and keep the sweeps' results
for the others (their skip flags: an exact fallback with no host round trip).

Packed documents (``cu_seqlens``) need no chunk layout: the kernels restart d at each
document's first token. Head dims are padded to a power of two >= 16 (keys with zeros, the
initial state with ones: padded coordinates never touch the real ones). ``chunk_size`` is not
used (the kernels walk tokens). The hyper-parameters (η, d_min, d_max, ε) are compiled into the
kernels, so they must be concrete numbers.

Inside a ``jit`` over a device mesh the kernel calls go through ``partition.sharded_call`` (batch
rows and heads stay sharded; with packed documents only heads). Without a GPU the kernels run in
interpret mode.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import osgm_mosaic, rows_mosaic
from pallas_kernels.osgm_sweep_triton import (
    G, INV_N, U_BWD, W, osgm_sweep, osgm_sweep_bwd, osgm_sweep_compose, osgm_sweep_compose_bwd)
from pallas_kernels.osgm_triton import AUX, BETA, DOC, FIRST, LAST, RET, osgm_bwd, osgm_fwd
from pallas_kernels.partition import lowered_once, match_types, sharded_call
from pallas_kernels.token_pieces import auto_pieces, rows, unrows
from pallas_kernels.triton_common import (
    MAX_HEAD_DIM, TraceDefaults, aux_rows, doc_columns, interpret_default, pad_last, pow2_dim,
    vary_alike)
from precond_linattn.chunked.osgm_picard import beta_cotangent, coefficients, picard_iterate
from precond_linattn.numerics import f32
from precond_linattn.varlen import segments


PICARD_TOL = 1e-6  # relative change of the coupling at which the Picard sweeps stop


@dataclasses.dataclass(frozen=True)
class Options:
    """Kernel tuning (static; the arithmetic of each token is the same for every setting): how
    many loop iterations ahead rows are loaded, warps per program, tokens per loop iteration
    (``unroll``: their d-independent work issued before their serial steps), and ``scalar_aux``:
    the per-token scalars (β, r, document flags) by scalar loads instead of an aux row and masked
    sums. ``bwd_unroll``: the backward kernel's own tokens per iteration (None: ``unroll`` up to
    8: at 16 the backward holds 255 registers). Defaults from RESULTS run 39 (APF phase 1 at
    8x2048x8x128, same process: 2 groups ahead, 16 tokens a forward iteration, 8 a backward one,
    scalar loads: fwd / fwd+bwd 0.70 / 1.38 ms against 0.87 / 1.49 at run 16's 2/1/8).
    ``picard_iters`` > 0: the forward and the backward
    by Picard sweeps (``osgm_sweep_triton``, programs over blocks of ``picard_block_k``
    coordinates, no reduction on the per-token chain) until the coupling ⟨d_t, s_t⟩ (the
    adjoint's ⟨μ_t, s_t⟩) settles, at most that many, then the token loops (exact either way;
    ``precond_linattn.chunked.osgm_picard`` has the algorithm and its convergence); 0: the token
    loops; None (the default): by shape, ``picard_by_shape``. ``picard_early_exit``: stop the
    sweeps once settled (a ``while_loop``: the GPU's host reads its predicate every sweep) and
    emit in one more, or (the default) run exactly ``picard_iters`` of them unrolled, the last
    one emitting, each sequence's flag from its last change, no host round trip
    (``_iterate``). ``picard_pieces``: each sweep over dense rows cut into that many sequence
    pieces (``token_pieces``: each piece's composed map, then the sweep, whose programs chain
    the maps of the pieces before theirs; it must divide T); None (the default):
    ``auto_pieces`` halved until it divides T; 1: no split; packed documents never split.
    ``mosaic_loops`` (the default since RESULTS run 93): both directions on the Mosaic GPU
    kernels of ``osgm_mosaic`` (Picard sweeps inside 64-token tiles, one coordinate a thread,
    the coupling by row sums; under differentiation the residuals are per-token rows and one
    state a tile instead of every d_t) where they run (K padded to 128, ``picard_iters`` 0 or
    None), else the Triton ones. Run 93, APF phase 1 at 8x2048x8x128 bf16, fwd / fwd+bwd
    (synchronous calls): 0.373 / 0.919 ms against the Triton loops' 0.604 / 1.292, and at
    1x2048x8x128 0.405 / 0.770 against 0.730 / 1.571 (the Triton sweeps of run 64: 0.459
    fwd+bwd). ``mosaic_warpgroups``: the Mosaic kernels' warpgroups a CTA, 1 or 2 (with 2, the
    default since RESULTS runs 124-125, a second warpgroup forms S and k̃ (forward) and ∂r, ∂k
    (backward) of neighbouring tiles while the first runs the sweeps; 16-bit keys (and ∂k̃)
    only, float32 ones take 1): APF phase 1 at 8x2048x8x128 bf16, fwd / fwd+bwd 0.215 / 0.454
    ms against 0.249 / 0.517 on one (RESULTS run 125; kernels 0.110 / 0.229 ms against 0.136
    / 0.266). ``mosaic_bound_stop``: the Mosaic kernels' sweeps of a tile end at
    ``osgm_mosaic._accepts``' contraction bound (True: within a quarter float32 spacing of the
    fixed point's values, at most an ulp from the bitwise stop; fewer sweeps, each dearer) or
    only when the coupling comes back bit for bit (False, the default: RESULTS run 170, APF
    phase 1 at 8x2048x8x128 bf16 on an H100, fwd / fwd+bwd 0.203 / 0.399 ms against 0.220-0.226
    / 0.419-0.420 with the bound). (Better first guesses for the sweeps, a first-order term
    in the forward and the uncoupled adjoint in the backward, saved a sweep a tile but no time
    on the H100 and were removed: NOTES, sessions 37-39.) ``stream``: the Mosaic kernels on
    that XLA GPU stream (``rows_mosaic.on_stream``: asynchronous beside the main stream, e.g.
    the backward's reverse scan beside a training step's weight gradients); None (the
    default): on the main stream (runs 179, 210 and 216: no faster, XLA scheduled nothing
    beside the kernels; ``rows_mosaic.on_stream``)."""

    prefetch: int = 2
    num_warps: int = 1
    unroll: int = 16
    scalar_aux: bool = True
    bwd_unroll: int | None = None
    picard_iters: int | None = None
    picard_block_k: int = 32
    picard_early_exit: bool = False
    picard_pieces: int | None = None
    mosaic_loops: bool = True
    mosaic_warpgroups: int = 2
    mosaic_bound_stop: bool = False
    stream: int | None = None

    def __post_init__(self):
        n = self.picard_iters
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"Options.picard_iters must be None or an int >= 0, got {n!r}")
        for name in ("prefetch", "num_warps", "unroll", "picard_block_k") + (
                ("bwd_unroll",) if self.bwd_unroll is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Options.{name} must be a positive int, got {value!r}")
        p = self.picard_pieces
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < 1):
            raise ValueError(f"Options.picard_pieces must be None or an int >= 1, got {p!r}")
        if self.mosaic_warpgroups not in (1, 2) or isinstance(self.mosaic_warpgroups, bool):
            raise ValueError(f"Options.mosaic_warpgroups must be 1 or 2, got "
                             f"{self.mosaic_warpgroups!r}")
        rows_mosaic.check_stream(self.stream)
        for name in ("scalar_aux", "picard_early_exit", "mosaic_loops", "mosaic_bound_stop"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Options.{name} must be a bool, got {getattr(self, name)!r}")


_DEFAULT = TraceDefaults("default_options", Options, Options())  # of calls that name none

# ``picard_iters=None``: the Picard sweeps (over ``auto_pieces``) where the token loops would run
# few one-warp programs over a long row. RESULTS run 50 (APF phase 1, bf16, H = 8, T = 2048, 4
# sweeps over auto pieces against the token loops): B = 1 (8 programs) fwd / fwd+bwd 0.414 /
# 0.588 ms against 0.583 / 1.110; B = 8 (64 programs) 0.711 / 1.622 against 0.685 / 1.382.
# Below PICARD_MIN_T not measured: the token loops stay. Three sweeps without early exit since
# RESULTS run 64 (v5.1, B = 1): fwd+bwd 0.459 ms against 0.618 with early exit after up to 4,
# forward kernels 99.6 µs in 21 launches against 122.6 in 33, and no host round trip; the
# paper's 340M settings settle in 3 (run 63's early exit stopped there).
# The Mosaic kernels keep few rows too: at 1x2048x8x128 the sweeps took phase 1 alone from
# 0.175 / 0.446 to 0.121 / 0.194 ms (RESULTS run 118, bench inputs), but the OSDN-340M prefill
# from 14.3 to 19.5 ms (run 119): that prefill's rows (OSDN, no retention) settle in 4 sweeps
# (``osgm_picard_steps`` on the CPU, every layer), so after 3 the token loops ran them all.
PICARD_ITERS = 3
PICARD_BELOW_PROGRAMS = 32
PICARD_MIN_T = 1024


def picard_by_shape(options: Options, *, B: int, H: int, T: int, K: int, packed: bool) -> Options:
    """``options`` with ``picard_iters`` None resolved: 0 where the Mosaic kernels take the call
    (``mosaic_loops``, K padded to 128), else PICARD_ITERS where the rows are dense,
    B · H < PICARD_BELOW_PROGRAMS (the token loops' programs) and T >= PICARD_MIN_T, else 0."""
    if options.picard_iters is not None:
        return options
    mosaic = options.mosaic_loops and osgm_mosaic.runs(K=K)
    few = not mosaic and not packed and B * H < PICARD_BELOW_PROGRAMS and T >= PICARD_MIN_T
    return dataclasses.replace(options, picard_iters=PICARD_ITERS if few else 0)


def default_options(options: Options | None):
    """Calls traced inside take ``options`` where they name none, as ``impl="pallas"`` /
    ``"auto"`` through the layers and models do (e.g. a benchmark of a model with the Picard
    sweeps); None keeps the current ones. Trace-time only: a function jitted and traced before
    keeps its kernels."""
    return _DEFAULT.use(options)


@dataclasses.dataclass(frozen=True)
class _Config:
    hyper: tuple  # (eta, d_min, d_max, eps) as floats
    beta_aware: bool
    packed: bool  # documents packed along T (cu_seqlens)
    options: Options
    interpret: bool
    pieces: int = 1  # sequence pieces of each dense row in the Picard sweeps
    retention: bool = True  # False: r ≡ 1 (no APF), compiled into the Mosaic kernels


def supports(*, K: int, dtype) -> bool:
    """Whether the kernels take this call (K up to MAX_HEAD_DIM after padding, any dtype)."""
    del dtype
    return pow2_dim(K) <= MAX_HEAD_DIM


def _call(cfg, kernel, args, in_axes, out_axes, **static):
    """``kernel(*args, **static)`` through ``sharded_call`` (the backward kernels at
    ``Options.bwd_unroll``)."""
    o = cfg.options
    unroll = o.unroll
    if kernel in (osgm_bwd, osgm_sweep_bwd, osgm_sweep_compose_bwd):
        unroll = o.bwd_unroll or min(o.unroll, 8)
    fn = functools.partial(kernel, hyper=cfg.hyper, beta_aware=cfg.beta_aware, packed=cfg.packed,
                           prefetch=o.prefetch, num_warps=o.num_warps, unroll=unroll,
                           scalar_aux=o.scalar_aux, interpret=cfg.interpret, **static)
    return sharded_call(lambda *xs: tuple(fn(*xs)), args, in_axes, out_axes,
                        shard_batch=not cfg.packed)


def _forward(cfg, k, aux, init, emit_d):
    """The token loop's results; with ``picard_iters`` the Picard sweeps' for the sequences whose
    coupling settled, the token loop running only for the others (``osgm_fwd``'s skip flags:
    an exact fallback without a host round trip)."""
    settled = ()
    if _mosaic_runs(cfg, k):  # (under differentiation: _scan_fwd's own call)
        return _mosaic_forward(cfg, k, aux, init)
    if cfg.options.picard_iters:
        out, ok = _picard_forward(cfg, k, aux, init, emit_d=emit_d)
        settled = (ok, *out)
    return _token_forward(cfg, k, aux, init, emit_d=emit_d, settled=settled)


def _mosaic_runs(cfg, k):
    """Whether ``Options.mosaic_loops`` takes this call."""
    return cfg.options.mosaic_loops and not cfg.options.picard_iters and osgm_mosaic.runs(
        K=k.shape[-1])


def _warpgroups(cfg, *seqs):
    """``Options.mosaic_warpgroups`` where two fit with the sequences ``seqs``, else 1."""
    return cfg.options.mosaic_warpgroups if rows_mosaic.pair_fits(*seqs) else 1


def _mosaic_call(cfg, kernel, args, in_axes, out_axes):
    """A kernel of ``osgm_mosaic`` through ``rows_mosaic.call``."""
    kernel = functools.partial(kernel, bounds=cfg.hyper[1:3], interpret=cfg.interpret,
                               packed=cfg.packed)
    return rows_mosaic.call(kernel, args, in_axes, out_axes, packed=cfg.packed,
                            interpret=cfg.interpret, stream=cfg.options.stream)


def _documents(cfg, aux):
    """Each token's document id and first / last flags [B, T] with packed documents, else None."""
    return tuple(aux[:, :, 0, c] for c in (DOC, FIRST, LAST)) if cfg.packed else None


def _mosaic_forward(cfg, k, aux, init, residuals=False):
    """``osgm_mosaic.osgm_fwd``'s results (T padded to whole tiles, then cut), its per-token
    coefficients from XLA: (k̃, final), with ``residuals`` also the backward's (the rows
    (u_t, a_t) and the states entering the tiles, as the kernel returns them)."""
    T = k.shape[1]
    Tp = rows_mosaic.padded_length(T)
    coefs = osgm_mosaic.coefficient_rows(_coefficients(cfg, k, aux), Tp, _documents(cfg, aux))
    out = _mosaic_call(
        cfg, functools.partial(osgm_mosaic.osgm_fwd, residuals=residuals,
                               warpgroups=_warpgroups(cfg, k),
                               bound_stop=cfg.options.mosaic_bound_stop,
                               retention=cfg.retention),
        [rows_mosaic.tile_padded(k, Tp), coefs, init], ["b t h k", "b h r t", "n h k"],
        ["b t h k", "n h k"] + (["b h j t", "b i h k"] if residuals else []))
    return (out[0][:, :T], *out[1:])


def _mosaic_backward(cfg, k, aux, residuals, init, dkw, dfinal):
    """``osgm_mosaic.osgm_bwd``'s cotangents from the forward's ``residuals``, ∂β from its γ_t
    elementwise (``osgm_picard.beta_cotangent``)."""
    T = k.shape[1]
    Tp = rows_mosaic.padded_length(T)
    eta, _, _, eps = cfg.hyper
    per_token = _coefficients(cfg, k, aux)
    fwd_rows, starts = residuals
    u, a = rows_mosaic.token_rows(fwd_rows, T)
    coefs = osgm_mosaic.backward_rows(per_token, u, a, eps, Tp, _documents(cfg, aux))
    dk, rows, dinit = _mosaic_call(
        cfg, functools.partial(osgm_mosaic.osgm_bwd, warpgroups=_warpgroups(cfg, k, dkw),
                               bound_stop=cfg.options.mosaic_bound_stop,
                               retention=cfg.retention),
        [rows_mosaic.tile_padded(k, Tp), rows_mosaic.tile_padded(dkw, Tp), coefs, starts, init,
         dfinal],
        ["b t h k", "b t h k", "b h r t", "b i h k", "n h k", "n h k"],
        ["b t h k", "b h j t", "n h k"])
    gamma, dr = rows_mosaic.token_rows(rows, T)
    dbeta = beta_cotangent(gamma, a, per_token, eta, cfg.beta_aware)
    daux = jnp.zeros_like(aux).at[..., BETA].set(dbeta).at[..., RET].set(dr)
    return dk[:, :T], daux, dinit


def _iterate(cfg, sweep, x0):
    """Picard sweeps from the coupling x0 [B p, H, 1, L] (``sweep(x, emit)`` -> [its block
    shares [B p, H, J, L], with ``emit`` the results]; x: block shares, which the kernels sum):
    (x [B p, H, L], the emitting sweep's results, [B] int32 flags: whether each sequence settled,
    PICARD_TOL relative to max(|x|, 1)), x being the coupling the emitting sweep ran with.
    ``picard_early_exit``: a ``while_loop`` until every sequence's coupling settled
    (``picard_iterate``, whose predicate the GPU's host reads every sweep), then one sweep that
    emits; else exactly ``picard_iters`` sweeps, unrolled, the last one emitting and each flag
    comparing the coupling of the emitted states with the one they ran with."""
    o, B = cfg.options, x0.shape[0] // cfg.pieces
    if o.picard_early_exit:  # the while loop's carry: the coupling (one share)
        x, _, ok, _ = picard_iterate(lambda x: (_coupling(sweep(x, False)[0])[:, :, None], None),
                                     x0, PICARD_TOL, o.picard_iters)
        return _coupling(x), sweep(x, True)[1:], jnp.broadcast_to(ok, (B,)).astype(jnp.int32)
    x = x0
    for _ in range(o.picard_iters - 1):  # each sweep sums the last one's shares itself
        x = sweep(x, False)[0]
    shares, *out = sweep(x, True)
    x, x_new = _coupling(x), _coupling(shares)
    change = jnp.max(jnp.abs(x_new - x).reshape(B, -1), 1)
    scale = jnp.maximum(jnp.max(jnp.abs(x_new).reshape(B, -1), 1), 1.0)
    return x, out, (change <= PICARD_TOL * scale).astype(jnp.int32)


def _coefficients(cfg, k, aux):
    """(s, n̄, g, w, r) of ``osgm_picard.coefficients`` from the kernels' inputs."""
    eta, _, _, eps = cfg.hyper
    return coefficients(k.astype(jnp.float32), aux[..., BETA], aux[..., RET], eta,
                        cfg.beta_aware, eps)


def _coupling(shares):
    """A sweep's block shares [R, H, J, L] summed into its coupling [R, H, L]."""
    return jnp.sum(shares, 2)


def _to_rows(a, p):
    """A per-token coupling [B, T, H] in the sweeps' layout, one share [B p, H, 1, T / p]."""
    return rows(a, p).transpose(0, 2, 1)[:, :, None]


def _to_tokens(a, p):
    """A coupling [B p, H, T / p] per token [B, T, H]."""
    return unrows(a.transpose(0, 2, 1), p)


def _sweeps(cfg, compose, kernel, n_maps, seqs, seq_axes, state, emit_axes, **static):
    """``sweep(x, emit)`` for ``_iterate``: ``kernel(*seqs, x, state, *maps)`` for a coupling x
    (block shares [B p, H, J, L]), its results [block shares] and with ``emit`` those
    ``emit_axes`` name; over p > 1 pieces the ``n_maps`` maps of ``compose(*seqs, x)`` first
    (the sweep kernels chain them)."""
    block_k = cfg.options.picard_block_k

    def sweep(x, emit):
        maps = [] if cfg.pieces == 1 else _call(cfg, compose, [*seqs, x], seq_axes + ["b h i t"],
                                                ["b h k"] * n_maps, block_k=block_k)
        return _call(cfg, kernel, [*seqs, x, state, *maps],
                     seq_axes + ["b h i t", "n h k"] + ["b h k"] * len(maps),
                     ["b h j t"] + (emit_axes if emit else []), emit=emit, pieces=cfg.pieces,
                     block_k=block_k, **static)

    return sweep


def _per_row(cfg, state):
    """Each sequence's state [B, H, K] as each row's [B p, H, K] (packed or one piece: as is)."""
    return state if cfg.packed or cfg.pieces == 1 else jnp.repeat(state, cfg.pieces, axis=0)


def _piece_state(cfg, state, piece):
    """Piece ``piece``'s state of each row [B p, H, K] as each sequence's [B, H, K]."""
    if cfg.packed or cfg.pieces == 1:
        return state
    return state.reshape(-1, cfg.pieces, *state.shape[1:])[:, piece]


_SETTLED = ["b", "b t h k", "n h k"]  # skip flags and the sweeps' results, as osgm_fwd's outputs


def _token_forward(cfg, k, aux, init, *, emit_d, settled=()):
    return _call(cfg, osgm_fwd, [k, aux, init, *settled],
                 ["b t h k", "b t h a", "n h k"] + _SETTLED[:len(settled)], ["b t h k", "n h k"],
                 emit_d=emit_d)


def _picard_forward(cfg, k, aux, init, *, emit_d):
    """Sweeps with u_t = w_t (1 − g_t a_t) from the last sweep's a_t = ⟨d_t, s_t⟩ (the first from
    d frozen at its initial state), one of them emitting (``_iterate``): ((k̃ or every d_t,
    final), [B] settled flags) (``_forward`` runs the token loop for the sequences that did not
    settle within ``Options.picard_iters`` sweeps). Over p pieces each sweep is
    ``osgm_sweep_compose`` then ``osgm_sweep`` (which chains the pieces' maps itself)."""
    H, p = k.shape[2], cfg.pieces
    s, _, g, w, _ = _coefficients(cfg, k, aux)
    if cfg.packed:  # each token's document's initial state
        start = init[aux[..., DOC].astype(jnp.int32), jnp.arange(H)]
    else:
        start = init[:, None]
    sweep = _sweeps(cfg, osgm_sweep_compose, osgm_sweep, 4,
                    [rows(k, p), rows(aux.at[..., W].set(w).at[..., G].set(g), p)],
                    ["b t h k", "b t h a"], _per_row(cfg, init), ["b t h k", "n h k"],
                    emit_d=emit_d)
    _, (out, final), ok = _iterate(cfg, sweep, _to_rows(jnp.sum(start * s, -1), p))
    return (unrows(out, p), _piece_state(cfg, final, -1)), ok


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(cfg, k, aux, init):
    return _forward(cfg, k, aux, init, False)


def _scan_fwd(cfg, k, aux, init):
    """Under differentiation the kernel emits every d_t (kept for the backward, which then does
    not re-run the token loop); k̃ = d ⊙ k is the kernel's own product and cast, so equal bit
    for bit. The Mosaic kernels keep less: per-token rows and the states entering the tiles."""
    if _mosaic_runs(cfg, k):
        k_write, final, *residuals = _mosaic_forward(cfg, k, aux, init, residuals=True)
        return (k_write, final), (k, aux, tuple(residuals), init)
    d, final = _forward(cfg, k, aux, init, True)
    return ((d * k.astype(jnp.float32)).astype(k.dtype), final), (k, aux, d, init)


def _scan_bwd(cfg, res, cts):
    k, aux, d, init = res  # (with the Mosaic kernels, their residuals in place of every d_t)
    if _mosaic_runs(cfg, k):
        dk, daux, dinit = _mosaic_backward(cfg, k, aux, d, init, *cts)
        return match_types((dk, daux, dinit), (k, aux, init))
    settled = ()
    if cfg.options.picard_iters:  # the token loop only where the sweeps did not settle
        grads, ok = _picard_backward(cfg, k, aux, d, *cts)
        settled = (ok, *grads)
    dk, daux, dinit = _token_backward(cfg, k, aux, d, *cts, settled=settled)
    return match_types((dk, daux, dinit), (k, aux, init))


_SEQ = ["b t h k", "b t h a", "b t h k", "b t h k", "n h k"]  # k, aux, d, dk̃, dfinal


def _token_backward(cfg, k, aux, d, dkw, dfinal, *, settled=()):
    out = ["b t h k", "b t h a", "n h k"]
    return _call(cfg, osgm_bwd, [k, aux, d, dkw, dfinal, *settled],
                 _SEQ + (["b", *out] if settled else []), out)


def _picard_backward(cfg, k, aux, d, dkw, dfinal):
    """The adjoint by reverse sweeps (``osgm_sweep_bwd``, over pieces each after
    ``osgm_sweep_compose_bwd``) with c_t = −w_t g_t γ_t from the last sweep's γ_t = ⟨μ_t, s_t⟩
    (the first with γ = 0), one of them emitting ∂k, the shares of ∂r and dinit (``_iterate``),
    ∂β elementwise (``osgm_picard.beta_cotangent``): (cotangents, [B] settled flags)
    (``_scan_bwd`` runs the token loop's reverse kernel for the other sequences)."""
    p, (eta, _, _, eps) = cfg.pieces, cfg.hyper
    coefs = _coefficients(cfg, k, aux)
    s, n, g, w, _ = coefs
    a = jnp.sum(d * s, -1)
    base = (aux.at[..., U_BWD].set(w * (1.0 - g * a)).at[..., W].set(w).at[..., G].set(g)
            .at[..., INV_N].set(jnp.where(n > eps, 1.0 / n, 0.0)))
    sweep = _sweeps(cfg, osgm_sweep_compose_bwd, osgm_sweep_bwd, 2,
                    [rows(x, p) for x in (k, base, d, dkw)], _SEQ[:4], _per_row(cfg, dfinal),
                    ["b t h k", "b h j t", "n h k"])
    gamma, (dk, dr, dinit), ok = _iterate(cfg, sweep, _to_rows(jnp.zeros_like(w), p))
    dbeta = beta_cotangent(_to_tokens(gamma, p), a, coefs, eta, cfg.beta_aware)
    daux = jnp.zeros_like(aux).at[..., BETA].set(dbeta).at[..., RET].set(
        _to_tokens(_coupling(dr), p))
    return (unrows(dk, p), daux, _piece_state(cfg, dinit, 0)), ok


_scan.defvjp(_scan_fwd, _scan_bwd)
_scan = lowered_once(_scan)


def _pieces(options, programs, T, packed):
    """Sequence pieces of the Picard sweeps (``Options.picard_pieces``): 1 without sweeps or
    with packed documents; None: ``auto_pieces`` halved until it divides T."""
    if packed or not options.picard_iters:
        return 1
    p = options.picard_pieces
    if p is None:
        p = auto_pieces(programs=programs, T=T)
        while T % p:
            p //= 2
    elif T % p:
        raise ValueError(f"Options.picard_pieces={p} must divide the sequence length T={T}")
    return p


def osgm_pallas(k, beta, retention, eta, d_min, d_max, beta_aware, eps, initial_state,
                cu_seqlens, chunk_size, options: Options | None = None,
                interpret: bool | None = None):
    """k̃ [B, T, H, K] (k's dtype) and final d [N, H, K] (float32) on the Pallas kernels.

    Arguments as ``precond_linattn.reference.osgm.osgm_reference``, each in its own dtype, plus
    the unused ``chunk_size``; ``options`` None: those of ``default_options`` (else Options()).
    Raises ValueError for a head dim the kernels cannot take or traced hyper-parameters."""
    del chunk_size
    B, T, H, K = k.shape
    options = picard_by_shape(_DEFAULT.current if options is None else options, B=B, H=H, T=T,
                              K=pow2_dim(K), packed=cu_seqlens is not None)
    if not supports(K=K, dtype=k.dtype):
        raise ValueError(f"impl='pallas' takes head dims K <= {MAX_HEAD_DIM}, got K={K}; "
                         "use impl='chunked' (impl='auto' falls back to it)")
    hyper = (eta, d_min, d_max, eps)
    if any(isinstance(x, jax.core.Tracer) for x in hyper):
        raise ValueError("impl='pallas' compiles eta, d_min, d_max and eps into the kernels: pass "
                         "numbers, not traced values (or use impl='chunked')")
    seg = segments(B, T, cu_seqlens)
    beta = f32(beta)
    columns = {BETA: beta, RET: 1.0 if retention is None else f32(retention)}
    aux = aux_rows(columns | doc_columns(seg, DOC, FIRST, LAST), AUX, beta)
    Kp = pow2_dim(K)
    init = (jnp.ones((seg.num_docs, H, Kp), jnp.float32) if initial_state is None else
            jnp.pad(f32(initial_state), [(0, 0), (0, 0), (0, Kp - K)], constant_values=1.0))
    cfg = _Config(tuple(float(x) for x in hyper), beta_aware, cu_seqlens is not None, options,
                  interpret_default() if interpret is None else interpret,
                  _pieces(options, B * H * (Kp // min(options.picard_block_k, Kp)), T,
                          cu_seqlens is not None), retention is not None)
    k_write, final = _scan(cfg, *vary_alike(pad_last(k, Kp), aux, init))
    return k_write[..., :K], final[..., :K]
