"""The Mosaic GPU token loops of OSGM, forward and reverse (pallas_kernels/osgm_mosaic.py,
``Options.mosaic_loops``), against the token-by-token reference in interpret mode, where they
apply and where they fall back, and their lowering for CUDA."""


import jax
import jax.numpy as jnp
import pytest

from benchmarks import probe_sweeps
from benchmarks.bench_osgm import make_inputs as make_bench_inputs
from pallas_kernels import osgm_mosaic, osgm_triton
from pallas_kernels.osgm_precond import Options, osgm_pallas
from benchmarks import mosaic_barriers
from benchmarks.mosaic_barriers import barriers, modules
from conftest import _lowered_for_cuda, assert_runs_match, assert_vmap_matches_loop
from precond_linattn.chunked.osgm_picard import coefficients
from test_pallas_osgm import clipped_fraction, make_inputs, precondition, run

MOSAIC = Options(mosaic_loops=True, picard_iters=0)


def triton_loops_poisoned(monkeypatch):
    """The Triton token loops write NaN wherever they run (so finite results show that the
    Mosaic kernels ran)."""
    def nan_body(n_in):
        def body(*refs, **static):
            for ref in refs[n_in:]:
                ref[...] = jnp.full(ref.shape, jnp.nan, ref.dtype)
        return body
    monkeypatch.setattr(osgm_triton, "_fwd", nan_body(3))
    monkeypatch.setattr(osgm_triton, "_bwd", nan_body(5))


@pytest.mark.parametrize("beta_aware, clip, init", [(True, "active", "inside"),
                                                    (False, "active", "outside"),
                                                    (True, "inactive", "inside")])
def test_matches_reference(beta_aware, clip, init, monkeypatch):
    """K = 100 (padded to 128), T = 70 (a partial last tile: padded tokens leave d and λ as
    they are), one batch row of two heads (two CTAs; the interpret mode's time goes with
    CTAs x tiles, so one batch row: the suite's time), APF retention: forward, final state and
    the gradients of k, β, r, d_1 within 2e-5 of the reference, the clip pinning many
    coordinates or never reached (initial states outside the box: both bounds clip); the
    Triton loops never ran."""
    x = make_inputs(3, b=1, n_init=1, t=70, k_dim=100, skewed=clip == "active", init=init)
    eta = 2.0 if clip == "active" else 0.003
    if clip == "active":
        assert clipped_fraction(x, eta) > 0.2
    triton_loops_poisoned(monkeypatch)
    assert_runs_match(run(MOSAIC, x, eta=eta, beta_aware=beta_aware),
                      run("reference", x, eta=eta, beta_aware=beta_aware), 2e-5)


def test_sub_ulp_updates_on_the_bound_stay_clipped(monkeypatch):
    """Coordinates on the bounds (d_1 = d_min, d_max or 1) under a tiny η, no retention: most
    updates move d by less than half its float32 spacing at d_max (1.2e-7), so the reference's
    r d + u s rounds back onto the bound, d stays there (most of the d_max coordinates, never
    moved) and the clip's derivative is 0. The kernels follow the reference's rounding: within
    2e-5 of it, gradients too (sweeps in finer coordinates, which keep such updates, let λ
    through these coordinates: ∂β off by 0.3, session 21's v4). One batch row of two heads,
    T = 70: two tiles, so the carried d crosses a tile boundary (the suite's time; was two
    rows of 130)."""
    x = make_inputs(5, b=1, n_init=1, t=70, k_dim=128, init="bounds")
    eta = 1e-8
    triton_loops_poisoned(monkeypatch)
    got = run(MOSAIC, x, eta=eta, retention=False)
    want = run("reference", x, eta=eta, retention=False)
    on_top = x["initial_state"] == 2.0
    assert float(jnp.mean(want[1][on_top] == 2.0)) > 0.5  # the case is there
    assert_runs_match(got, want, 2e-5)


def test_bf16_keys(monkeypatch):
    """bf16 keys: k̃ = d ⊙ k rounded once, as the Triton loop's (within 2e-6 of it); one batch
    row of two heads, one tile (the suite's time)."""
    x = make_inputs(4, b=1, n_init=1, t=64, k_dim=128, skewed=True, dtype=jnp.bfloat16)
    x["initial_state"] = x["initial_state"].astype(jnp.float32)
    want = precondition(Options(picard_iters=0), x, eta=2.0)
    triton_loops_poisoned(monkeypatch)
    got = precondition(MOSAIC, x, eta=2.0)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) <= 2e-6


@pytest.mark.heavy
@pytest.mark.parametrize("retention", [True, False])
def test_packed_documents(monkeypatch, retention):
    """Documents of 5, 1 (first and last token at once), 58 and 6 tokens in one row of 70 (a
    boundary inside each tile, a partial last tile), the clip active, with APF retention and
    without (the kernels' r ≡ 1 form): forward, each document's final state and every
    gradient within 2e-5 of the reference, the documents' initial states given (without them
    the wrapper passes ones, the same kernel path); the Triton loops never ran."""
    x = make_inputs(6, b=1, t=70, k_dim=128, n_init=4, skewed=True)
    kw = dict(eta=2.0, cu_seqlens=jnp.asarray([0, 5, 6, 64, 70], jnp.int32), retention=retention)
    triton_loops_poisoned(monkeypatch)
    grads = ("k", "beta", "initial_state") + (("retention",) if retention else ())
    assert_runs_match(run(MOSAIC, x, **kw), run("reference", x, **kw), 2e-5, grads)


@pytest.mark.heavy
def test_vmapped_packed_rows(monkeypatch):
    """Rows of packed documents under ``jax.vmap`` (as the train step runs them): each row's
    gradients equal its own call's (the paper's η: the sweeps settle in a few)."""
    x = make_inputs(7, t=40, k_dim=128)
    cu = jnp.asarray([0, 17, 40], jnp.int32)
    triton_loops_poisoned(monkeypatch)

    def grads(k, beta, r):
        def loss(k, beta, r):
            kw, final = osgm_pallas(k, beta, r, 0.003, 0.5, 2.0, True, 1e-6, None, cu, 64, MOSAIC)
            return jnp.sum(jnp.sin(kw)) + jnp.sum(final ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(k, beta, r)

    args = [x[n][:, None] for n in ("k", "beta", "retention")]  # [B, 1, T, ...]
    assert_vmap_matches_loop(grads, args)


def test_falls_back_below_128(monkeypatch):
    """K padded below 128: the Triton loops run (the Mosaic ones are never called) and the
    results are the reference's."""
    def refuse(*a, **kw):
        raise AssertionError("an osgm_mosaic kernel was called")
    monkeypatch.setattr(osgm_mosaic, "osgm_fwd", refuse)
    monkeypatch.setattr(osgm_mosaic, "osgm_bwd", refuse)
    x = make_inputs(5, t=30, k_dim=24)
    assert_runs_match(run(MOSAIC, x, eta=1.0), run("reference", x, eta=1.0), 2e-5)


@pytest.mark.parametrize("b", [1, 4])
def test_default_options_take_the_mosaic_kernels(b, monkeypatch):
    """``osgm_pallas`` with the default options at K = 128 lowers the Mosaic kernels both ways
    and no Triton kernel, also at B · H = 2, where the Triton path would take the sweeps (the
    Triton kernels counted in the text of the lowering that ``modules`` made, as
    ``triton_kernels_lowered_for_cuda`` counts them: one lowering, the suite's time)."""
    s = jax.ShapeDtypeStruct
    args = [s((b, 1024, 2, 128), jnp.bfloat16), s((b, 1024, 2), jnp.bfloat16),
            s((b, 1024, 2), jnp.bfloat16), s((b, 2, 128), jnp.float32)]

    def loss(k, beta, r, d0):
        kw, final = osgm_pallas(k, beta, r, 0.003, 0.5, 2.0, True, 1e-6, d0, None, 64,
                                interpret=False)
        return jnp.sum(kw.astype(jnp.float32) ** 2) + jnp.sum(final)

    grad = lambda *a: jax.grad(loss, argnums=(0, 1, 2, 3))(*a)  # noqa: E731
    texts = []
    monkeypatch.setattr(mosaic_barriers, "_lowered_for_cuda",
                        lambda *a: texts.append(_lowered_for_cuda(*a)) or texts[-1])
    assert sorted(modules(grad, args)) == ["osgm_bwd_mosaic", "osgm_fwd_mosaic"]
    assert len(texts) == 1 and "custom_call @mosaic_gpu" in texts[0]
    assert texts[0].count("__gpu$xla.gpu.triton") == 0


def test_bad_shapes_raise():
    k = jnp.zeros((1, 64, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="K = 128"):
        osgm_mosaic.osgm_fwd(k, jnp.zeros((1, 1, 4, 64)), jnp.ones((1, 1, 64)),
                             bounds=(0.5, 2.0), interpret=True)
    k = jnp.zeros((1, 64, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match=r"coefs must be \[B, H, 4, Tp\]"):  # a row short
        osgm_mosaic.osgm_fwd(k, jnp.zeros((1, 1, 3, 64)), jnp.ones((1, 1, 128)),
                             bounds=(0.5, 2.0), interpret=True)
    with pytest.raises(ValueError, match=r"coefs must be \[B, H, 7, Tp\] \(packed=True\)"):
        osgm_mosaic.osgm_bwd(k, k, jnp.zeros((1, 1, 4, 64)), jnp.ones((1, 1, 1, 128)),
                             jnp.ones((2, 1, 128)), jnp.ones((2, 1, 128)), bounds=(0.5, 2.0),
                             interpret=True, packed=True)
    with pytest.raises(ValueError, match="mosaic_loops must be a bool"):
        Options(mosaic_loops=1)
    with pytest.raises(ValueError, match="mosaic_bound_stop must be a bool"):
        Options(mosaic_bound_stop=0)


@pytest.mark.parametrize("dtype, residuals, packed, retention", [
    (jnp.bfloat16, False, False, True), (jnp.float32, True, True, True),
    (jnp.bfloat16, True, False, False)])
def test_lowers_for_cuda(dtype, residuals, packed, retention):
    """Through Mosaic GPU's own passes (layout inference of the per-thread rows, the tiles'
    row sums and the sweeps' while loop; with packed documents the restart rows and the
    document states), three tiles each way; no warpgroup barrier inside the sweeps' token
    loops (loop depth 3: tiles, sweeps, tokens), where Pallas would put two around each row
    store by default."""
    s, docs = jax.ShapeDtypeStruct, 3 * packed
    seq, state = s((2, 192, 2, 128), dtype), s((5 if packed else 2, 2, 128), jnp.float32)
    fwd = lambda k, c, i: osgm_mosaic.osgm_fwd(k, c, i, bounds=(0.5, 2.0), interpret=False,  # noqa: E731
                                               packed=packed, residuals=residuals,
                                               retention=retention)
    bwd = lambda *a: osgm_mosaic.osgm_bwd(*a, bounds=(0.5, 2.0), interpret=False,  # noqa: E731
                                          packed=packed, retention=retention)
    starts = s((2, 3, 2, 128), jnp.float32)
    for fn, args, name in [
            (fwd, (seq, s((2, 2, 4 + docs, 192), jnp.float32), state), "osgm_fwd_mosaic"),
            (bwd, (seq, seq, s((2, 2, 4 + docs, 192), jnp.float32), starts, state, state),
             "osgm_bwd_mosaic")]:
        found = modules(fn, args)
        assert list(found) == [name]
        assert max(barriers(found[name])) == 2


MOST_BITWISE = 4  # sweeps a tile at the paper's settings with the bitwise stop


def paper_settings(t, r=None, **options):
    """bench_osgm's inputs (η = 0.003, unit keys, APF retention ~0.998, or ``r`` given) at one
    row and head of t tokens: (the forward's arguments, the backward's given the forward's
    residuals, run with the kernels' ``options``)."""
    x, _ = make_bench_inputs(jax.random.PRNGKey(3), 1, t, 1, 128, jnp.float32)
    coefs = coefficients(x["k"], x["beta"], x["r"] if r is None else r, 0.003, True, 1e-6)
    rows, init = osgm_mosaic.coefficient_rows(coefs, t), jnp.ones((1, 1, 128), jnp.float32)
    _, _, res, starts = osgm_mosaic.osgm_fwd(x["k"], rows, init, bounds=(0.5, 2.0),
                                             interpret=True, residuals=True, **options)
    u, a = (jnp.moveaxis(res[:, :, i], 1, 2) for i in range(2))
    return ((x["k"], rows, init), (x["k"], x["k"] * 0.5,
            osgm_mosaic.backward_rows(coefs, u, a, 1e-6, t), starts, init, init * 0.1))


def both_ways(fwd_args, bwd_args, **options):
    kw = dict(bounds=(0.5, 2.0), interpret=True, **options)
    return (osgm_mosaic.osgm_fwd(*fwd_args, residuals=True, **kw),
            osgm_mosaic.osgm_bwd(*bwd_args, **kw))


@pytest.mark.parametrize("bound_stop, most_fwd, most_bwd", [(True, 2, 3), (False, MOST_BITWISE,
                                                                           MOST_BITWISE)])
def test_sweeps_settle_in_a_few_at_the_paper_settings(monkeypatch, bound_stop, most_fwd, most_bwd):
    """At the paper's settings, with the bound (``bound_stop``), every tile stops after at most 2
    sweeps forward (the guess follows the retention: a sweep moves it by ~1e-4, the next by
    ~1e-7, which ``_accepts`` takes; once d sits on d_min the first sweep's ~3e-5 is taken) and
    3 in reverse (from γ = 0); bit for bit after at most MOST_BITWISE each way. Counted by
    probe_sweeps' counting ``_settle`` (whose forward results are the real ones)."""
    fwd_args, bwd_args = paper_settings(128)
    real = both_ways(fwd_args, bwd_args, bound_stop=bound_stop)
    monkeypatch.setattr(osgm_mosaic, "_settle", probe_sweeps.counting_settle)
    counted = both_ways(fwd_args, bwd_args, bound_stop=bound_stop)
    for got, want in zip(counted[0][:2], real[0][:2]):
        assert jnp.array_equal(got, want)
    for code, most in ((counted[0][2][:, :, 1], most_fwd), (counted[1][1][:, :, 0], most_bwd)):
        code = code[..., ::osgm_mosaic.TILE]  # n + 1000 m, each tile's row
        assert int(jnp.max(code % 1000)) <= most and int(jnp.min(code // 1000)) >= 1


def test_stopping_early_moves_each_tile_by_a_quarter_spacing():
    """What the sweeps emit when ``_accepts`` stops them against sweeping until the coupling
    comes back bit for bit (the default ``bound_stop=False``, one sweep more a tile here): k̃, the final
    d, the entering states and ∂k, ∂d_1 not bitwise the same, but within 2^-24 of the largest
    value a tile (4 tiles): a quarter spacing before rounding, at most an ulp after."""
    fwd_args, bwd_args = paper_settings(256)
    stopped = both_ways(fwd_args, bwd_args, bound_stop=True)
    settled = both_ways(fwd_args, bwd_args)
    pairs = [(stopped[0][i], settled[0][i]) for i in (0, 1, 3)]
    pairs += [(stopped[1][i], settled[1][i]) for i in (0, 2)]
    assert any(not jnp.array_equal(a, b) for a, b in pairs)
    for a, b in pairs:
        assert float(jnp.max(jnp.abs(a - b))) <= 4 * 2.0 ** -24 * float(jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("bound_stop", [True, False])
def test_stop_option_reaches_the_kernels(monkeypatch, bound_stop):
    """``Options.mosaic_bound_stop`` of the public op's options arrives as both Mosaic kernels'
    ``bound_stop`` (forward and backward of one gradient, interpret mode)."""
    from test_kernel_streams import osgm_inputs, osgm_loss
    seen = []
    for name in ("osgm_fwd", "osgm_bwd"):
        real = getattr(osgm_mosaic, name)
        monkeypatch.setattr(osgm_mosaic, name, lambda *a, real=real, name=name, **kw:
                            seen.append((name, kw["bound_stop"])) or real(*a, **kw))
    options = Options(picard_iters=0, mosaic_bound_stop=bound_stop)
    jax.grad(osgm_loss(options, interpret=True), argnums=(0, 1, 2))(*osgm_inputs())
    assert sorted(set(seen)) == [("osgm_bwd", bound_stop), ("osgm_fwd", bound_stop)]


def test_without_retention_the_r_rows_are_never_read():
    """``retention=False`` (vanilla OSDN: r ≡ 1 compiled in) on rows whose r and p are random
    gives bit for bit what the retention path gives on rows with r ≡ 1 (k̃, final d, the
    residuals, ∂k, γ, ∂d_1), and ∂r = 0; two tiles each way, both warpgroup layouts."""
    t = 128
    ones = jnp.ones((1, t, 1), jnp.float32)
    noise = jax.random.uniform(jax.random.PRNGKey(5), (1, t, 1), minval=0.5, maxval=0.9)
    for warpgroups in (1, 2):
        dtype = jnp.float32 if warpgroups == 1 else jnp.bfloat16
        want = both_ways(*_cast(paper_settings(t, ones), dtype), warpgroups=warpgroups)
        got = both_ways(*_cast(paper_settings(t, noise, retention=False), dtype),
                        warpgroups=warpgroups, retention=False)
        for a, b in zip(got[0] + got[1][::2], want[0] + want[1][::2]):
            assert jnp.array_equal(a, b)
        assert jnp.array_equal(got[1][1][:, :, 0], want[1][1][:, :, 0])  # γ
        assert float(jnp.max(jnp.abs(want[1][1][:, :, 1]))) > 0  # ∂r, with retention
        assert not jnp.any(got[1][1][:, :, 1])


def _cast(settings, dtype):
    """``paper_settings``' arguments with k and ∂k̃ in ``dtype`` (two warpgroups take 16-bit)."""
    (k, rows, init), (_, dkw, *rest) = settings
    return (k.astype(dtype), rows, init), (k.astype(dtype), dkw.astype(dtype), *rest)


def test_vanilla_calls_take_the_kernels_without_retention(monkeypatch):
    """The public op passes ``retention=False`` to both Mosaic kernels exactly when it has no
    retention (OSDN), True with one (OSDN-APF)."""
    from test_kernel_streams import osgm_inputs
    seen = []
    for name in ("osgm_fwd", "osgm_bwd"):
        real = getattr(osgm_mosaic, name)
        monkeypatch.setattr(osgm_mosaic, name, lambda *a, real=real, name=name, **kw:
                            seen.append((name, kw["retention"])) or real(*a, **kw))
    k, beta, r = osgm_inputs()
    for retention in (None, r):
        seen.clear()
        loss = lambda k, beta: jnp.sum(osgm_pallas(  # noqa: E731
            k, beta, retention, 0.003, 0.5, 2.0, True, 1e-6, None, None, 64,
            Options(picard_iters=0), interpret=True)[0].astype(jnp.float32) ** 2)
        jax.grad(loss, argnums=(0, 1))(k, beta)
        assert set(seen) == {("osgm_fwd", retention is not None),
                             ("osgm_bwd", retention is not None)}
