"""The state passes that apply T themselves (pallas_kernels/state_wy_mosaic.py) against
``state_mosaic``'s passes fed with the WY tensors of the same T (interpret mode), and their
lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import delta_rule, inverse_mosaic, state_mosaic, state_wy_mosaic
from pallas_kernels.delta_rule import Options, delta_rule_pallas
from pallas_kernels.state_wy_mosaic import BETA, BETA_GAMMA, GAMMA, TAIL
from pallas_kernels.triton_common import Dots
from pallas_kernels.wy_triton import wy_inverse
from precond_linattn.chunked.delta import decay_sums
from conftest import (assert_repeats_bitwise, assert_vmap_matches_loop,
                      mosaic_kernels_lowered_for_cuda)
from test_pallas_precision import (assert_within_fla_bars, kernel_runs, packed_documents_runs, rel_rms)

B, H, NC, C, V = 2, 2, 3, 64, 128
TP, BF16, F32 = NC * C, jnp.bfloat16, jnp.float32
SCALE = 0.3
# row 0: a document of 2 chunks, then one of 1; row 1: one document of 3
FLAGS = tuple(jnp.asarray(x, jnp.int32) for x in (
    [[0, 0, 1], [2, 2, 2]], [[1, 0, 1], [1, 0, 0]], [[0, 1, 1], [0, 0, 1]]))


def inputs(rand, K):
    """Kernel-layout bf16 q, k, k̃ [B, Tp, H, K], v [B, Tp, H, V], β and log decays g [B, Tp, H]
    (per-chunk decays down to ~0.2: Γ, βΓ and Γ_C/Γ far apart), their T, P, Γ_C and row
    vectors (``wy_inverse``; ``test_row_vectors`` checks those)."""
    x = rand.delta_inputs(B, TP, H, K, V, decay="scalar", dtype=BF16)
    g = 3 * x["log_decay"].astype(F32)
    P, gc, T, vecs = wy_inverse(x["q"], x["k"], x["write_key"], x["beta"], g, chunk=C,
                                dots=Dots("tf32x3", interpret=True), num_warps=4, num_stages=1,
                                out_dtype=BF16, t_dtype=BF16)
    return dict(T=T, k=x["k"], kw=x["write_key"], v=x["v"], q=x["q"], P=P, vecs=vecs, gc=gc,
                beta=x["beta"], g=g)


def wy_tensors(x):
    """W, U, K̃', Q' [B, H, Tp, ·] (bf16) of ``x``'s T and inputs, formed in float32:
    T Diag(βΓ) K, T Diag(β) V, Diag(Γ_C/Γ) K̃, Diag(Γ) Q."""
    def row(r):
        return x["vecs"][:, :, r, :, None]

    def heads(a):
        return jnp.swapaxes(a, 1, 2).astype(F32)

    T = x["T"].astype(F32).reshape(B, H, NC, C, C)

    def apply(a):
        return jnp.einsum("bhnij,bhnjd->bhnid", T, a.reshape(B, H, NC, C, -1),
                          precision="highest").reshape(B, H, TP, -1)

    wy = (apply(row(BETA_GAMMA) * heads(x["k"])), apply(row(BETA) * heads(x["v"])),
          row(TAIL) * heads(x["kw"]), row(GAMMA) * heads(x["q"]))
    return tuple(a.astype(BF16) for a in wy)


def assert_close(got, want, names):
    """Relative RMS error <= 1e-2 (bf16 operands rounded at other points of the same algebra: the WY
    tensors once when stored against Y, R Diag(Γ_C/Γ), dRᵀ T Diag(βΓ) here)."""
    for a, b, name in zip(got, want, names):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert bool(jnp.all(jnp.isfinite(a.astype(F32)))), name
        assert rel_rms(a, b) <= 1e-2, (name, rel_rms(a, b))


@pytest.mark.parametrize("K", [128])  # K = 64: the op tests (K = 40 padded)
def test_forward_pass_matches_the_wy_pass(rand, K):
    """Chunk states, R, final document states (from initial ones) and outputs as
    ``state_mosaic.state_fwd`` gives from W, U, K̃', Q' of the same T."""
    x = inputs(rand, K)
    init = rand.normal(3, H, K, V)
    got = state_wy_mosaic.state_fwd(*list(x.values())[:8], init, *FLAGS, scale=SCALE, out_dtype=BF16,
                                    num_docs=3, interpret=True)
    W, U, kwt, qd = wy_tensors(x)
    want = state_mosaic.state_fwd(W, U, kwt, x["gc"], init, *FLAGS, num_docs=3, interpret=True,
                                  output=(qd, x["P"], SCALE, BF16))
    assert_close(got, want, ("states", "R", "final", "o"))


@pytest.mark.parametrize("K", [128])  # K = 64: the op tests (K = 40 padded)
def test_backward_pass_matches_the_wy_pass(rand, K):
    """dR, the chunk-end cotangents and dS_0 as ``state_mosaic.state_bwd`` gives from W, K̃',
    Q' of the same T (its G formed in the pass from dO, as here)."""
    x = inputs(rand, K)
    A = rand.normal(B, H, TP, V, dtype=BF16)
    do = rand.normal(B, TP, H, V, dtype=BF16)
    dfinal = rand.normal(3, H, K, V)
    got = state_wy_mosaic.state_bwd(x["T"], x["k"], x["kw"], x["q"], x["vecs"], x["gc"], A, do,
                                    dfinal, *FLAGS, scale=SCALE, interpret=True)
    W, _, kwt, qd = wy_tensors(x)
    want = state_mosaic.state_bwd(W, kwt, x["gc"], A, None, dfinal, *FLAGS, interpret=True,
                                  products=(qd, do, SCALE))
    assert_close(got, want, ("dR", "dS_C", "dS_0"))


def mosaic_inputs(rand, K):
    """``inputs`` with T, P from ``inverse_mosaic`` (two passes) and its rows for P formed in
    the passes (``wy_inverse_rows``: the same rows and γ fifth)."""
    x = inputs(rand, K)
    sums = [a.reshape(x["g"].shape) for a in decay_sums(x["g"].reshape(B, NC, C, H), 2)]
    P, gc, T, vecs = inverse_mosaic.wy_inverse(x["q"], x["k"], x["kw"], x["beta"], *sums,
                                               interpret=True, passes=2)
    gc5, T5, vecs5 = inverse_mosaic.wy_inverse_rows(x["k"], x["kw"], x["beta"], *sums,
                                                    interpret=True, passes=2)
    for a, b in ((gc, gc5), (T, T5), (vecs, vecs5[:, :, :4])):
        np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32))
    np.testing.assert_array_equal(vecs5[:, :, 4], jnp.moveaxis(sums[0], 2, 1))
    return x | dict(T=T, P=P, gc=gc, vecs=vecs, vecs5=vecs5)


def test_passes_form_p_as_the_inverse_does(rand):
    """With P None the forward forms P = (Q K̃ᵀ) ⊙ D from γ (the rows' fifth) and gives the
    bits of the pass fed the inverse's P; the backward forms Aᵀ = scale dOᵀ P in float32 and
    gives what the pass fed A = scale Pᵀ dO rounded to bf16 gives, to that rounding (dR is
    rounded to bf16 after A joins it, so mostly the same bits)."""
    x = mosaic_inputs(rand, 128)
    init = rand.normal(3, H, 128, V)
    common = dict(scale=SCALE, out_dtype=BF16, num_docs=3, interpret=True)
    fed = state_wy_mosaic.state_fwd(*[x[n] for n in ("T", "k", "kw", "v", "q", "P", "vecs")],
                                    x["gc"], init, *FLAGS, **common)
    formed = state_wy_mosaic.state_fwd(*[x[n] for n in ("T", "k", "kw", "v", "q")], None,
                                       x["vecs5"], x["gc"], init, *FLAGS, **common)
    for a, b in zip(fed, formed):
        np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32))
    do = rand.normal(B, TP, H, V, dtype=BF16)
    dfinal = rand.normal(3, H, 128, V)
    P = x["P"].astype(F32)
    A = (SCALE * jnp.einsum("bhnij,bnihv->bhnjv", P.reshape(B, H, NC, C, C),
                            do.astype(F32).reshape(B, NC, C, H, V), precision="highest"))
    args = [x[n] for n in ("T", "k", "kw", "q")]
    fed = state_wy_mosaic.state_bwd(*args, x["vecs"], x["gc"], A.reshape(B, H, TP, V).astype(BF16),
                                    do, dfinal, *FLAGS, scale=SCALE, interpret=True)
    formed = state_wy_mosaic.state_bwd(*args, x["vecs5"], x["gc"], None, do, dfinal, *FLAGS,
                                       scale=SCALE, interpret=True)
    for a, b, name in zip(formed, fed, ("dR", "dS_C", "dS_0")):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_rms(a, b) <= 4e-3, (name, rel_rms(a, b))


def test_forward_in_two_warpgroups_gives_the_same_bits(rand):
    """``state_fwd(warpgroups=2)`` (the output in a second warpgroup, P formed there) gives the
    one-warpgroup pass's bits, with and without its stores, three packed documents and initial
    states; P given with two warpgroups is refused."""
    x = mosaic_inputs(rand, 128)
    init = rand.normal(3, H, 128, V)
    common = dict(scale=SCALE, out_dtype=BF16, num_docs=3, interpret=True)
    args = [x[n] for n in ("T", "k", "kw", "v", "q")]
    for store in (True, False):
        one, two = (state_wy_mosaic.state_fwd(*args, None, x["vecs5"], x["gc"], init, *FLAGS,
                                              store=store, warpgroups=w, **common) for w in (1, 2))
        for a, b in zip(one, two, strict=True):
            np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32))
    with pytest.raises(ValueError, match="warpgroups must be 1, or 2 with P None"):
        state_wy_mosaic.state_fwd(*args, x["P"], x["vecs"], x["gc"], init, *FLAGS, warpgroups=2,
                                  **common)


def test_passes_lower_for_cuda():
    """Both passes (the forward with and without its stores, and forming P, in one warpgroup
    and in two; the backward fed A and forming it) through Mosaic GPU's own passes (layout
    inference) at K = V = 128."""
    K = 128
    s = jax.ShapeDtypeStruct
    tok = lambda d: s((B, TP, H, d), BF16)  # noqa: E731
    rows = lambda d: s((B, H, TP, d), BF16)  # noqa: E731
    common = dict(T=rows(C), k=tok(K), kw=tok(K))
    flags = tuple(s(f.shape, jnp.int32) for f in FLAGS)
    vecs, gc = s((B, H, 4, TP), F32), s((B, H, NC, K), F32)
    vecs5 = s((B, H, 5, TP), F32)
    for store, formed, wgs in ((True, False, 1), (False, False, 1), (True, True, 1),
                               (True, True, 2), (False, True, 2)):  # formed: P None
        def fwd(T, k, kw, v, q, *rest, store=store, formed=formed, wgs=wgs):
            P, vecs, gc, *fl = (None, *rest) if formed else rest
            return state_wy_mosaic.state_fwd(T, k, kw, v, q, P, vecs, gc, None, *fl, scale=SCALE,
                                             out_dtype=BF16, num_docs=None, interpret=False,
                                             store=store, warpgroups=wgs)
        P = () if formed else (rows(C),)
        assert mosaic_kernels_lowered_for_cuda(
            fwd, (*common.values(), tok(V), tok(K), *P, vecs5 if formed else vecs, gc,
                  *flags)) == 1
    for formed in (False, True):  # formed: A None
        def bwd(T, k, kw, q, vecs, gc, *rest, formed=formed):
            A, do, df, *fl = (None, *rest) if formed else rest
            return state_wy_mosaic.state_bwd(T, k, kw, q, vecs, gc, A, do, df, *fl, scale=SCALE,
                                             interpret=False)
        A = () if formed else (rows(V),)
        assert mosaic_kernels_lowered_for_cuda(
            bwd, (*common.values(), tok(K), vecs5 if formed else vecs, gc, *A, tok(V),
                  s((B, H, K, V), F32), *flags)) == 1


def test_row_vectors(rand):
    """``wy_inverse``'s rows β, βΓ, Γ, Γ_C/Γ [B, H, 4, Tp] from the in-chunk sums γ, σ of the
    log decays as XLA forms them (``decay_sums``), to float32 rounding."""
    x = inputs(rand, 64)
    gamma, sigma = (s.reshape(B, TP, H) for s in decay_sums(x["g"].reshape(B, NC, C, H), 2))
    beta, Gam = x["beta"].astype(F32), jnp.exp(gamma)
    want = jnp.stack([beta, beta * Gam, Gam, jnp.exp(sigma)], axis=1)  # [B, 4, Tp, H]
    np.testing.assert_allclose(x["vecs"], jnp.transpose(want, (0, 3, 1, 2)), rtol=2e-6,
                               atol=1e-7)


FUSED_GRADS = Options(serial_backend="mosaic", fused_grads=True)
SERIAL_WY = Options(serial_backend="mosaic", fused_grads=True, wy_in_serial=True,
                    inverse_backend="triton")  # this file's passes on the Triton inverse
WY_IN_HBM = Options(serial_backend="mosaic", fused_grads=True, wy_in_serial=False)


def count_passes(monkeypatch):
    """The names of ``state_wy_mosaic``'s passes as the op calls them."""
    calls = []
    for name in ("state_fwd", "state_bwd"):
        real = getattr(state_wy_mosaic, name)
        monkeypatch.setattr(state_wy_mosaic, name,
                            lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    return calls


@pytest.mark.parametrize("decay", [None, "scalar"])
def test_op_within_fla_bars(rand, decay, monkeypatch):
    """The op with ``wy_in_serial`` (T = 150: two chunks and a tail; K = 40 and V = 48 padded
    to 64; an initial state): outputs, final state and every gradient within FLA's bars of the
    float32 reference, and each no more than 1.25x as far from it as the same pipeline with the
    WY tensors through HBM (the two round at different places: they differ from each other
    about as much as from the reference, so closeness to each other says less); both new passes
    ran: the backward's once, the forward's twice (traced in the op's own jaxpr under
    ``partition.lowered_once``'s jit, without stores, and in its VJP's forward)."""
    calls = count_passes(monkeypatch)
    serial, wy, ref = kernel_runs(rand, decay, 7, SERIAL_WY, WY_IN_HBM, K=40)
    assert calls == ["state_fwd", "state_fwd", "state_bwd"]
    assert_within_fla_bars(serial, ref)
    pairs = [("o", serial[0], wy[0], ref[0]), ("final", serial[1], wy[1], ref[1])]
    pairs += [(n, serial[2][n], wy[2][n], ref[2][n]) for n in ref[2]]
    for name, a, b, want in pairs:
        assert rel_rms(a, want) <= 1.25 * rel_rms(b, want), name


@pytest.mark.parametrize("options", [SERIAL_WY, FUSED_GRADS], ids=["triton_inverse", "default"])
def test_op_packed_documents(rand, options):
    """Three packed documents (64, 1 and 85 tokens) with per-document initial states and a
    scalar decay, on the Triton inverse and on the defaults (the Mosaic one): within FLA's bars
    of the float32 reference, outputs, final states and every gradient."""
    assert_within_fla_bars(*packed_documents_runs(rand, options))


def test_refused_where_it_does_not_apply(rand):
    """``wy_in_serial=True`` without ``fused_grads`` or with sequence pieces: a ValueError
    naming both; None resolves to True with fused_grads over one piece, else to False."""
    x = rand.delta_inputs(1, 256, 1, 64, 64, dtype=BF16)
    args = (x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 0.125, None, None, 64)
    for options in (Options(serial_backend="mosaic", fused_grads=False, wy_in_serial=True),
                    Options(serial_backend="mosaic", fused_grads=True, wy_in_serial=True,
                            sequence_pieces=2)):
        with pytest.raises(ValueError, match="wy_in_serial needs fused_grads and one sequence"):
            delta_rule_pallas(*args, options)
    seen = []
    real = delta_rule._core
    delta_rule._core = lambda cfg, *a: seen.append(cfg.options.wy_in_serial) or real(cfg, *a)
    try:
        for options in (FUSED_GRADS, Options(serial_backend="mosaic", fused_grads=False),
                        Options(serial_backend="mosaic", fused_grads=True, sequence_pieces=2)):
            delta_rule_pallas(*args, options)
    finally:
        delta_rule._core = real
    assert seen == [True, False, False]


def test_p_in_serial_resolves_and_refuses(rand, monkeypatch):
    """``Options.p_in_serial``: None resolves to True with the Mosaic inverse (the default
    here) and to False with the Triton one; True with the Triton inverse is a ValueError naming
    what it needs, a non-bool one naming the choices. ``forward_warpgroups`` reaches the
    forward pass and needs it; None gives two warpgroups where the pass stores states (under
    a gradient) and one where it does not. The op with it never runs ``dout_products`` (its backward forms
    A in the pass)."""
    x = rand.delta_inputs(1, 64, 1, 64, 64, dtype=BF16)
    args = (x["q"], x["k"], x["write_key"], x["v"], x["beta"], None, 0.125, None, None, 64)
    seen = []
    real = delta_rule._core
    monkeypatch.setattr(delta_rule, "_core",
                        lambda cfg, *a: seen.append(cfg.options.p_in_serial) or real(cfg, *a))
    for options in (FUSED_GRADS, SERIAL_WY, Options(serial_backend="mosaic", fused_grads=True,
                                                    p_in_serial=False)):
        jax.eval_shape(lambda *a: delta_rule_pallas(*a, *args[5:], options), *args[:5])
    assert seen == [True, False, False]
    with pytest.raises(ValueError, match="p_in_serial needs inverse_backend='mosaic'"):
        delta_rule_pallas(*args, Options(serial_backend="mosaic", fused_grads=True,
                                         inverse_backend="triton", p_in_serial=True))
    with pytest.raises(ValueError, match="p_in_serial must be None, True or False"):
        Options(p_in_serial=1)
    with pytest.raises(ValueError, match="forward_warpgroups=2 needs p_in_serial"):
        delta_rule_pallas(*args, Options(serial_backend="mosaic", fused_grads=True,
                                         p_in_serial=False, forward_warpgroups=2))
    with pytest.raises(ValueError, match="forward_warpgroups must be None, 1 or 2"):
        Options(forward_warpgroups=3)
    wgs = []
    real_fwd = state_wy_mosaic.state_fwd
    monkeypatch.setattr(state_wy_mosaic, "state_fwd",
                        lambda *a, **kw: wgs.append(kw["warpgroups"]) or real_fwd(*a, **kw))
    jax.clear_caches()  # the traces above, made before this patch
    for w in (1, 2, None):
        op = lambda *a: delta_rule_pallas(*a, *args[5:], Options(  # noqa: E731
            serial_backend="mosaic", fused_grads=True, forward_warpgroups=w))[0]
        jax.eval_shape(op, *args[:5])
        jax.eval_shape(jax.grad(lambda *a: jnp.sum(op(*a).astype(F32))), *args[:5])
    assert wgs == [1, 1, 2, 2, 1, 2]
    monkeypatch.setattr(delta_rule, "dout_products", None)  # called: a TypeError
    jax.eval_shape(jax.grad(lambda q: jnp.sum(delta_rule_pallas(
        q, *args[1:], FUSED_GRADS)[0].astype(F32))), args[0])


def test_under_vmap_repeat_bitwise_and_effect_free(rand):
    """Gradients of a loss of the op with ``wy_in_serial`` (and the default Mosaic inverse):
    ``jax.vmap`` over rows as [1, T] sequences equals the rows one by one, a second run
    (compiled afresh) is bitwise the first, and traced for the GPU both passes and the inverse
    (fed P / A and forming them) carry no effects (so ``jax.checkpoint`` and
    ``custom_partitioning`` take them there)."""
    x = rand.delta_inputs(2, 100, 2, 64, 64, decay="scalar", dtype=BF16)
    names = ("q", "k", "write_key", "v", "beta", "log_decay")

    def loss(*args):
        o, final = delta_rule_pallas(*args, 0.125, None, None, 64, FUSED_GRADS)
        return jnp.sum(jnp.sin(o.astype(F32))) + jnp.sum(final ** 2)

    grad = jax.grad(loss, argnums=tuple(range(6)))
    args = [x[n] for n in names]
    assert_vmap_matches_loop(grad, [a.reshape(2, 1, *a.shape[1:]) for a in args])
    assert_repeats_bitwise(lambda: jax.jit(grad)(*args))
    s = jax.ShapeDtypeStruct
    tok, rows = s((1, C, 1, 64), BF16), s((1, 1, C, C), BF16)
    flags = (s((1, 1), jnp.int32),) * 3
    vecs, gc = s((1, 1, 4, C), F32), s((1, 1, 1, 64), F32)
    fwd = jax.make_jaxpr(lambda *a: state_wy_mosaic.state_fwd(
        *a[:8], None, *a[8:], scale=0.1, out_dtype=BF16, num_docs=None, interpret=False))(
        rows, tok, tok, tok, tok, rows, vecs, gc, *flags)
    bwd = jax.make_jaxpr(lambda *a: state_wy_mosaic.state_bwd(
        *a, scale=0.1, interpret=False))(rows, tok, tok, tok, vecs, gc, s((1, 1, C, 64), BF16),
                                          tok, s((1, 1, 64, 64), F32), *flags)
    inverse = jax.make_jaxpr(lambda *a: inverse_mosaic.inverse(*a, interpret=False))(
        tok, tok, tok, s((1, 1, C), F32), s((1, 1, C), F32))
    vecs5 = s((1, 1, 5, C), F32)  # the default path: P formed in the passes, no q in the inverse
    fwd_p = jax.make_jaxpr(lambda *a: state_wy_mosaic.state_fwd(
        *a[:5], None, *a[5:7], None, *a[7:], scale=0.1, out_dtype=BF16, num_docs=None,
        interpret=False))(rows, tok, tok, tok, tok, vecs5, gc, *flags)
    bwd_a = jax.make_jaxpr(lambda *a: state_wy_mosaic.state_bwd(
        *a[:6], None, *a[6:], scale=0.1, interpret=False))(rows, tok, tok, tok, vecs5, gc, tok,
                                                           s((1, 1, 64, 64), F32), *flags)
    inverse_t = jax.make_jaxpr(lambda *a: inverse_mosaic.inverse(None, *a, interpret=False))(
        tok, tok, s((1, 1, C), F32), s((1, 1, C), F32))
    for jaxpr in (fwd, bwd, inverse, fwd_p, bwd_a, inverse_t):
        assert not jaxpr.effects


def test_forward_without_gradients_stores_nothing_else(rand, monkeypatch):
    """The op's forward alone runs the pass without the chunk states and R (``store=False``)
    and gives the bits of the forward that stores them for a backward."""
    stores = []
    real = state_wy_mosaic.state_fwd
    monkeypatch.setattr(state_wy_mosaic, "state_fwd",
                        lambda *a, **kw: stores.append(kw["store"]) or real(*a, **kw))
    x = rand.delta_inputs(2, 150, 2, 64, 64, decay="scalar", dtype=BF16)

    def op(q, k, kw, v, beta, g):
        return delta_rule_pallas(q, k, kw, v, beta, g, 0.125, None, None, 64, SERIAL_WY)

    args = [x[n] for n in ("q", "k", "write_key", "v", "beta", "log_decay")]
    alone = jax.jit(op)(*args)
    stored = jax.jit(lambda *a: jax.vjp(op, *a)[0])(*args)
    assert stores == [False, True]
    for a, b in zip(alone, stored):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

