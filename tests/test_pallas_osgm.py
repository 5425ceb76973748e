"""osgm_precondition(impl="pallas") against the token-by-token reference (interpret mode on CPU)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond_linattn as pla
from pallas_kernels import REGISTRY, osgm_precond
from pallas_kernels.osgm_precond import Options, osgm_pallas
from conftest import (assert_close, assert_repeats_bitwise, assert_runs_match,
                      assert_vmap_matches_loop, fixed_loss_run, fixed_loss_step,
                      triton_kernels_lowered_for_cuda)

B, T, H, K = 2, 37, 2, 24
D_MIN, D_MAX = 0.5, 2.0


def make_inputs(seed, *, b=B, t=T, k_dim=K, n_init=B, skewed=False, init="inside",
                dtype=jnp.float32):
    """Keys (``skewed``: a few large coordinates, some exactly zero, so that the clip pins them),
    β in (0.05, 0.95), retention in (0.9, 1), initial d inside, on or outside the box."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, t, H, k_dim))
    if skewed:
        k *= np.where(np.arange(k_dim) < 3, 4.0, 0.3)
        k[..., 3:6] = 0.0  # s = 0: these coordinates never move, pinned ones stay on the bound
    state = {"inside": lambda: rng.uniform(0.7, 1.8, (n_init, H, k_dim)),
             "bounds": lambda: np.resize([D_MIN, D_MAX, 1.0], (n_init, H, k_dim)),
             "outside": lambda: rng.choice([0.2, 0.5, 1.0, 2.0, 2.6], (n_init, H, k_dim))}[init]()
    x = dict(k=jnp.asarray(k, dtype), beta=jnp.asarray(rng.uniform(0.05, 0.95, (b, t, H)), dtype),
             retention=jnp.asarray(rng.uniform(0.9, 1.0, (b, t, H)), dtype),
             initial_state=jnp.asarray(state, jnp.float32))
    return x


def precondition(impl, x, *, eta, beta_aware=True, retention=True, cu_seqlens=None,
                 initial=True):
    """(k̃, final d) of ``impl``: an ``osgm_precondition`` impl name, or ``Options`` for the Pallas
    kernels with those options."""
    r = x["retention"] if retention else None
    d0 = x["initial_state"] if initial else None
    if isinstance(impl, Options):
        return osgm_pallas(x["k"], x["beta"], r, eta, D_MIN, D_MAX, beta_aware, 1e-6, d0,
                           cu_seqlens, 64, impl)
    return pla.osgm_precondition(x["k"], x["beta"], eta=eta, d_min=D_MIN, d_max=D_MAX,
                                 retention=r, beta_aware=beta_aware, initial_state=d0,
                                 output_final_state=True, cu_seqlens=cu_seqlens, impl=impl)


def run(impl, x, **kw):
    """k̃, final d and the gradients of conftest's fixed loss w.r.t. every input
    (``precondition``'s arguments)."""
    return fixed_loss_run(lambda x: precondition(impl, x, **kw), x)


def clipped_fraction(x, eta, **kw):
    """Share of state coordinates sitting on a bound after the scan (the clip was active)."""
    _, final = pla.osgm_precondition(x["k"], x["beta"], eta=eta, d_min=D_MIN, d_max=D_MAX,
                                     initial_state=x["initial_state"], output_final_state=True,
                                     impl="reference", **kw)
    return float(jnp.mean((final == D_MIN) | (final == D_MAX)))


def test_registered():
    supports, kernel = REGISTRY["osgm_precondition"]
    assert kernel is osgm_pallas
    assert supports(K=128, dtype=jnp.bfloat16) and supports(K=100, dtype=jnp.float32)
    assert not supports(K=256, dtype=jnp.float32)


@pytest.mark.parametrize("beta_aware", [True, False])
@pytest.mark.parametrize("retention", [True, False])
@pytest.mark.parametrize("clip", ["active", "inactive"])
def test_matches_reference(beta_aware, retention, clip):
    """Forward, final state and gradients (k, β, r, d_1); odd T, padded K; the clip pinning many
    coordinates (large η, skewed keys) or never reached (the paper's η = 0.003)."""
    active = clip == "active"
    x = make_inputs(0, skewed=active)
    eta = 2.0 if active else 0.003
    if active:
        assert clipped_fraction(x, eta) > 0.2
    grads = ("k", "beta", "initial_state") + (("retention",) if retention else ())
    assert_runs_match(run("pallas", x, eta=eta, beta_aware=beta_aware, retention=retention),
                      run("reference", x, eta=eta, beta_aware=beta_aware, retention=retention),
                      2e-5, grads)


def test_initial_state_on_and_outside_the_box():
    """Coordinates starting exactly on d_min / d_max (pinned: zero-key coordinates tie with the
    bound), then outside the box (used unclipped for the first token): both starts through the
    same two compiled programs (the suite's time)."""
    pallas, reference = (fixed_loss_step(lambda x, i=impl: precondition(i, x, eta=1.0))
                         for impl in ("pallas", "reference"))
    for init in ("bounds", "outside"):
        x = make_inputs(1, skewed=True, init=init)
        (_, got), got_grads = pallas(x)
        (_, want), want_grads = reference(x)
        assert_runs_match((*got, got_grads), (*want, want_grads), 2e-5)


def test_default_initial_state():
    x = make_inputs(2, skewed=True)
    got = run("pallas", x, eta=2.0, initial=False)
    assert_runs_match(got, run("reference", x, eta=2.0, initial=False), 2e-5,
                      ("k", "beta", "retention"))


@pytest.mark.parametrize("initial", [True, False])
def test_packed_documents(initial):
    """cu_seqlens: d restarts at each document (from its own initial state, or ones)."""
    cu = jnp.asarray([0, 5, 22, 37], jnp.int32)
    x = make_inputs(3, b=1, n_init=3, skewed=True)
    assert clipped_fraction(x, 2.0, cu_seqlens=cu) > 0.2
    grads = ("k", "beta", "retention") + (("initial_state",) if initial else ())
    assert_runs_match(run("pallas", x, eta=2.0, cu_seqlens=cu, initial=initial),
                      run("reference", x, eta=2.0, cu_seqlens=cu, initial=initial), 2e-5, grads)


def test_bf16_inputs():
    """bf16 inputs: float32 inside, so the same answer as the reference on the same bf16 values
    up to one bf16 rounding of k̃ and of each gradient (the final state is float32)."""
    x = make_inputs(4, dtype=jnp.bfloat16)
    got, want = run("pallas", x, eta=0.3), run("reference", x, eta=0.3)
    assert got[2]["k"].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    assert_runs_match(got, want, 4e-3)


@pytest.mark.heavy
def test_vmap():
    x = make_inputs(5, skewed=True)

    def grads(k, beta, r, d0):
        def loss(k, beta, r, d0):
            kw, final = pla.osgm_precondition(k, beta, eta=2.0, retention=r, initial_state=d0,
                                              output_final_state=True, impl="pallas")
            return jnp.sum(jnp.sin(kw)) + jnp.sum(final ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(k, beta, r, d0)

    args = [x["k"], x["beta"], x["retention"], x["initial_state"]]
    assert_vmap_matches_loop(grads, [a.reshape(B, 1, *a.shape[1:]) for a in args])


def test_second_run_bitwise_identical():
    x = make_inputs(6, skewed=True)
    assert_repeats_bitwise(lambda: run("pallas", x, eta=2.0))


def test_unsupported_calls_raise():
    x = make_inputs(7, k_dim=256)
    with pytest.raises(ValueError, match="K <= 128"):
        pla.osgm_precondition(x["k"], x["beta"], impl="pallas")
    y = make_inputs(7)
    with pytest.raises(ValueError, match="traced"):
        jax.jit(lambda eta: pla.osgm_precondition(y["k"], y["beta"], eta=eta, impl="pallas"))(0.1)


# Unrolled token loops (Options.unroll) and scalar aux loads (Options.scalar_aux) do the same
# arithmetic per token, issued in another order. Compiled as a loop, XLA:CPU may pick another
# summation order for a row reduction of the kernel body (seen: sequential vs tree for ⟨d, s⟩),
# hence the 1e-6 bar; with the token loops unrolled at trace time (jax.disable_jit) every
# variant is the same straight-line program up to the order of independent operations, and the
# results are bitwise those of unroll=1.


ONE_TOKEN = Options(prefetch=4, unroll=1)  # one token per loop step, the kernels before unrolling


def unrolled_case(case, t):
    """(inputs, run keywords), the clip active: "dense" (β-aware, APF) and "beta-free" (r ≡ 1)
    two rows; "packed" documents of 5, 1 (first and last token at once), t − 10 and 4 tokens, so
    that starts and ends fall inside groups of 2, 3 and 4 and in the shorter last group."""
    if case == "packed":
        cu = jnp.asarray([0, 5, 6, t - 4, t], jnp.int32)
        return make_inputs(8, b=1, t=t, n_init=4, skewed=True), dict(eta=2.0, cu_seqlens=cu)
    return make_inputs(9, t=t, skewed=True), dict(eta=2.0, beta_aware=case == "dense",
                                                   retention=case == "dense")


def test_unrolled_bitwise_when_traced_unrolled():
    """Packed documents, T = 11: forward k̃, and under differentiation k̃, the final d and all
    gradients bitwise those of unroll=1 for the default 8 tokens a group (a last group of 3, a
    document boundary inside a group) with scalar aux loads (other unrolls and the row loads
    compiled in ``test_unrolled_matches_reference``)."""
    x, kw = unrolled_case("packed", 11)
    options = Options(scalar_aux=True)
    with jax.disable_jit():
        want = precondition(ONE_TOKEN, x, **kw)[0], run(ONE_TOKEN, x, **kw)
        got = precondition(options, x, **kw)[0], run(options, x, **kw)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case, options", [("dense", Options(unroll=4, scalar_aux=True)),
                                           ("beta-free", Options(unroll=3)), ("dense", Options()),
                                           ("dense", Options(unroll=16, bwd_unroll=3))])
def test_unrolled_matches_reference(case, options):
    """Compiled, two rows of T = 37 (a last group of 1): forward k̃, and under differentiation
    k̃, the final d and all gradients within 1e-6 of unroll=1 and 2e-5 of the reference (packed
    documents: ``test_unrolled_bitwise_when_traced_unrolled``)."""
    x, kw = unrolled_case(case, 37)
    assert clipped_fraction(x, 2.0, cu_seqlens=kw.get("cu_seqlens")) > 0.2
    forward, one_token, reference = unrolled_baselines(case)
    assert_close(jax.jit(lambda x: precondition(options, x, **kw)[0])(x), forward, 1e-6,
                 "k_write (forward)")
    grads = ("k", "beta", "initial_state") + (("retention",) if kw.get("retention", True) else ())
    got = run(options, x, **kw)
    assert_runs_match(got, one_token, 1e-6, grads)
    assert_runs_match(got, reference, 2e-5, grads)


@functools.cache
def unrolled_baselines(case):
    """(forward k̃ of unroll=1, ``run`` of unroll=1, ``run`` of the reference) on
    ``unrolled_case(case, 37)``: the same for every option compared with them, so computed once
    a process (the suite's time; no test patches the kernels while they run)."""
    x, kw = unrolled_case(case, 37)
    return (jax.jit(lambda x: precondition(ONE_TOKEN, x, **kw)[0])(x), run(ONE_TOKEN, x, **kw),
            run("reference", x, **kw))


# K = 24 padded to 32: 4 coordinate blocks; early exit: as many sweeps as the case needs
PICARD = Options(picard_iters=16, picard_block_k=8, picard_early_exit=True)


def poisoned(f):
    """``f`` with every float result replaced by NaN (to show which results were used)."""
    def g(*args, **kw):
        return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), f(*args, **kw))
    return g


def poison_token_loops(setattr_):
    """Make the token-loop kernels write NaN wherever they run (their bodies, ``osgm_triton._fwd``
    and ``_bwd``), so finite results show that they skipped every sequence (the Picard sweeps
    settled); ``setattr_``: ``monkeypatch.setattr`` or ``setattr``."""
    from pallas_kernels import osgm_triton

    def nan_body(n_in):
        def body(*refs, **static):
            for ref in refs[n_in:]:
                ref[...] = jnp.full(ref.shape, jnp.nan, ref.dtype)
        return body

    setattr_(osgm_triton, "_fwd", nan_body(3))
    setattr_(osgm_triton, "_bwd", nan_body(5))


@pytest.mark.parametrize("case, options", [
    ("dense", PICARD), ("beta-free", PICARD), ("packed", PICARD),
    ("dense", Options(picard_iters=6, picard_early_exit=False, scalar_aux=True))])
def test_picard_sweeps_match_reference(case, options, monkeypatch):
    """The forward and backward by Picard sweeps (4 programs a head), the token loops poisoned so
    that only the sweeps can give finite results: with the clip active (η = 2) k̃, the final d
    and all gradients within 2e-5 of the reference; at the paper's η = 0.003 k̃ and the final d.
    Also exactly 6 sweeps each way without early exit, with scalar aux loads. T = 21: a group
    of 16 tokens and a shorter one (the suite's time: interpret mode runs each sweep)."""
    poison_token_loops(monkeypatch.setattr)
    x, kw = unrolled_case(case, 21)
    paper = dict(kw, eta=0.003)
    # each impl's two runs (η = 2 differentiated, η = 0.003 forward) compiled as one program
    got, want = (jax.jit(lambda x, o=o: (run(o, x, **kw), precondition(o, x, **paper)))(x)
                 for o in (options, "reference"))
    grads = ("k", "beta", "initial_state") + (("retention",) if kw.get("retention", True) else ())
    assert_runs_match(got[0], want[0], 2e-5, grads)
    for a, b, name in zip(got[1], want[1], ("k_write", "final")):
        assert_close(a, b, 2e-5, name)


@pytest.mark.parametrize("case, pieces", [("dense", 4), ("beta-free", 3)])
def test_picard_sweeps_over_sequence_pieces(case, pieces, monkeypatch):
    """Sweeps over dense rows of T = 36 cut into pieces (of 9 or 12 tokens: groups of 16 never
    fill one), the token loops poisoned: each piece's composed map, the chain of the maps before
    it (inside the sweep kernel) and the sweep give k̃, the final d and all gradients within 2e-5
    of the reference (η = 2: the clip active, the maps' bounds matter; a piece started from the
    sequence's initial state would be far off); the maps were composed each way. A count that
    does not divide T is refused."""
    poison_token_loops(monkeypatch.setattr)
    composed = []
    for name in ("osgm_sweep_compose", "osgm_sweep_compose_bwd"):
        real = getattr(osgm_precond, name)
        monkeypatch.setattr(osgm_precond, name, lambda *a, _name=name, _real=real, **kw:
                            composed.append(_name) or _real(*a, **kw))
    x, kw = unrolled_case(case, 36)
    options = Options(picard_iters=16, picard_block_k=8, picard_pieces=pieces,
                      picard_early_exit=True)
    grads = ("k", "beta", "initial_state") + (("retention",) if kw.get("retention", True) else ())
    assert_runs_match(run(options, x, **kw), run("reference", x, **kw), 2e-5, grads)
    assert set(composed) == {"osgm_sweep_compose", "osgm_sweep_compose_bwd"}
    with pytest.raises(ValueError, match="picard_pieces"):
        precondition(Options(picard_iters=2, picard_pieces=5), x, **kw)


def test_default_options_reach_calls_that_name_none(monkeypatch):
    """``default_options``: ``osgm_precondition(impl="pallas")``, as the layers call it, runs the
    Picard sweeps over pieces inside the context (the token loops poisoned: exact), the token
    loops again after it; None keeps the enclosing options; anything else is refused."""
    poison_token_loops(monkeypatch.setattr)
    x, kw = unrolled_case("dense", 36)
    want = precondition("reference", x, **kw)
    with osgm_precond.default_options(Options(picard_iters=16, picard_pieces=4,
                                              picard_early_exit=True)):
        with osgm_precond.default_options(None):  # keeps the enclosing options
            got = precondition("pallas", x, **kw)
    for a, b, name in zip(got, want, ("k_write", "final")):
        assert_close(a, b, 2e-5, name)
    assert bool(jnp.all(jnp.isnan(precondition("pallas", x, **kw)[0])))
    with pytest.raises(ValueError, match="default_options"):
        with osgm_precond.default_options(dict(picard_iters=4)):
            pass


def test_picard_sweeps_under_vmap_skip_the_token_loops(monkeypatch):
    """vmap over rows (as the train step maps packed rows): the rows' results and gradients as
    the batch's, and the token loops skip every row (their bodies poisoned: finite results);
    T = 21: a group of 16 tokens and a shorter one."""
    x, kw = unrolled_case("dense", 21)
    batch = run(PICARD, x, **kw)
    poison_token_loops(monkeypatch.setattr)
    rows = {n: a[:, None] for n, a in x.items()}  # two rows of batch 1
    per_row = jax.jit(jax.vmap(lambda x: run(PICARD, x, **kw)))(rows)
    for a, b in zip(jax.tree.leaves(per_row), jax.tree.leaves(batch)):
        np.testing.assert_allclose(a.reshape(b.shape), b, rtol=1e-5, atol=1e-6)


def test_picard_sweeps_fall_back_to_the_token_loop(monkeypatch):
    """One sweep allowed at η = 2 (not enough), the emitting sweeps poisoned: the token loops'
    results and gradients, bit for bit."""
    def emits_poison(kernel):
        def sweep(*args, emit, **kw):
            out = kernel(*args, emit=emit, **kw)
            return out[:1] + poisoned(lambda: out[1:])() if emit else out
        return sweep

    for name in ("osgm_sweep", "osgm_sweep_bwd"):
        monkeypatch.setattr(osgm_precond, name, emits_poison(getattr(osgm_precond, name)))
    x, kw = unrolled_case("dense", 37)
    got, want = (run(o, x, **kw) for o in (Options(picard_iters=1), Options()))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_token_loops_skip_the_flagged_rows():
    """``osgm_fwd`` / ``osgm_bwd`` with skip flags [1, 0]: row 0 keeps the given results (NaN
    here) and row 1 is the plain kernel's, bit for bit, forward and reverse."""
    from pallas_kernels.osgm_triton import AUX, BETA, RET, osgm_bwd, osgm_fwd
    x = make_inputs(3, b=2, t=21)
    aux = jnp.zeros((2, 21, H, AUX)).at[..., BETA].set(x["beta"]).at[..., RET].set(x["retention"])
    static = dict(hyper=(0.5, D_MIN, D_MAX, 1e-6), beta_aware=True, packed=False, prefetch=2,
                  num_warps=1, unroll=4, scalar_aux=True, interpret=True)
    fwd_in = (x["k"], aux, x["initial_state"])
    plain = osgm_fwd(*fwd_in, emit_d=True, **static)
    skip = jnp.asarray([1, 0], jnp.int32)
    nan = [jnp.full_like(a, jnp.nan) for a in plain]
    got = osgm_fwd(*fwd_in, skip, *nan, emit_d=True, **static)
    bwd_in = (x["k"], aux, plain[0], x["k"] * 0.5, x["initial_state"] * 0.1)
    plain_bwd = osgm_bwd(*bwd_in, **static)
    got_bwd = osgm_bwd(*bwd_in, skip, *[jnp.full_like(a, jnp.nan) for a in plain_bwd], **static)
    for a, b in zip((*got, *got_bwd), (*plain, *plain_bwd)):
        assert bool(jnp.all(jnp.isnan(a[0]))) and not bool(jnp.any(jnp.isnan(b[1])))
        np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("field, value", [("unroll", 0), ("unroll", 2.0), ("prefetch", 0),
                                          ("scalar_aux", 1), ("bwd_unroll", 0),
                                          ("picard_iters", -1), ("picard_iters", True),
                                          ("picard_block_k", 0),
                                          ("picard_early_exit", 1), ("picard_pieces", 0),
                                          ("picard_pieces", 2.0)])
def test_bad_options_raise(field, value):
    with pytest.raises(ValueError, match=f"Options.{field}"):
        Options(**{field: value})


@pytest.mark.parametrize("options", [ONE_TOKEN, Options(), Options(unroll=4),
                                     Options(unroll=3, scalar_aux=True),
                                     Options(picard_iters=3)])
@pytest.mark.parametrize("packed", [False, True])
def test_lowers_for_cuda(options, packed):
    """Forward and backward kernels go through the Triton lowering for CUDA (no GPU needed: an
    abstract H100 mesh; PTX and ptxas are not reached); K = 128, bf16, T odd (the Triton
    kernels: the Mosaic ones, the default at K = 128, have their own test)."""
    options = dataclasses.replace(options, mosaic_loops=False)
    b, t = (1, 37) if packed else (2, 37)
    cu = jnp.asarray([0, 5, 22, t], jnp.int32) if packed else None
    n = 3 if packed else b

    def loss(k, beta, r, d0):
        kw, final = osgm_pallas(k, beta, r, 0.003, 0.5, 2.0, not packed, 1e-6, d0, cu, 64, options,
                                interpret=False)
        return jnp.sum(kw.astype(jnp.float32) ** 2) + jnp.sum(final)

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((b, t, H, 128), jnp.bfloat16), ((b, t, H), jnp.bfloat16), ((b, t, H), jnp.bfloat16),
        ((n, H, 128), jnp.float32))]
    # the token loops each way; with Picard sweeps (T = 37: one piece, no early exit) also
    # picard_iters sweeps each way, the last emitting (None: the token loops at this shape);
    # 3: every sweep kernel (the first from one share, one from the block shares, the emitting)
    assert triton_kernels_lowered_for_cuda(loss, args) == 2 + 2 * (options.picard_iters or 0)


@pytest.mark.parametrize("b, h, t, k, packed, iters", [
    (1, 8, 2048, 64, False, 3), (3, 10, 1024, 64, False, 3), (4, 8, 2048, 64, False, 0),
    (1, 8, 1023, 64, False, 0), (1, 8, 2048, 64, True, 0), (1, 8, 2048, 128, False, 0)])
def test_picard_by_shape(b, h, t, k, packed, iters):
    """``picard_iters=None`` (the default): none where the Mosaic kernels take the call (K
    padded to 128); else the sweeps where the token loops would run fewer than 32 one-warp
    programs (B · H) over at least 1024 dense tokens (RESULTS run 50), else the token loops
    (as at K = 128 without ``mosaic_loops``); a number is kept as given."""
    got = osgm_precond.picard_by_shape(Options(), B=b, H=h, T=t, K=k, packed=packed)
    assert got.picard_iters == iters and got.picard_pieces is None
    triton = osgm_precond.picard_by_shape(Options(mosaic_loops=False), B=b, H=h, T=t, K=k,
                                          packed=packed)
    assert triton.picard_iters == (3 if (b * h < 32 and t >= 1024 and not packed) else 0)
    assert osgm_precond.picard_by_shape(Options(picard_iters=2), B=b, H=h, T=t, K=k,
                                        packed=packed).picard_iters == 2


@pytest.mark.parametrize("b, sweeps", [(1, True), (16, False)])
def test_default_options_choose_the_sweeps_by_shape(b, sweeps):
    """``osgm_pallas`` with the default options but the Triton kernels at T = 1024: B · H = 2
    lowers the sweeps over pieces (each way 3 sweeps, the last emitting, each with its compose
    kernel) besides the token loops, B · H = 32 the token loops only (K = 128, bf16, CUDA
    lowering without a GPU)."""
    t = 1024

    def loss(k, beta, r, d0):
        kw, final = osgm_pallas(k, beta, r, 0.003, 0.5, 2.0, True, 1e-6, d0, None, 64,
                                Options(mosaic_loops=False), interpret=False)
        return jnp.sum(kw.astype(jnp.float32) ** 2) + jnp.sum(final)

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((b, t, H, 128), jnp.bfloat16), ((b, t, H), jnp.bfloat16), ((b, t, H), jnp.bfloat16),
        ((b, H, 128), jnp.float32))]
    assert triton_kernels_lowered_for_cuda(loss, args) == 2 + 2 * 2 * 3 * sweeps


def test_sweep_pieces_lower_for_cuda():
    """The sweeps over sequence pieces (each sweep: the pieces' composed maps, then the sweep)
    go through the Triton lowering for CUDA; K = 128, bf16, T = 40 in 2 pieces: each way 3
    sweeps (the first from one share, one from the block shares, the last emitting), each with
    its compose kernel, besides the token loops."""
    b, t = 2, 40

    def loss(k, beta, r, d0):
        kw, final = osgm_pallas(k, beta, r, 0.003, 0.5, 2.0, True, 1e-6, d0, None, 64,
                                Options(picard_iters=3, picard_pieces=2), interpret=False)
        return jnp.sum(kw.astype(jnp.float32) ** 2) + jnp.sum(final)

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((b, t, H, 128), jnp.bfloat16), ((b, t, H), jnp.bfloat16), ((b, t, H), jnp.bfloat16),
        ((b, H, 128), jnp.float32))]
    assert triton_kernels_lowered_for_cuda(loss, args) == 2 + 2 * 2 * 3
