"""benchmarks/pieces_model.py, the float32 model of phase 1 cut into sequence pieces: its scan is
the reference token loop, its affine maps are the unclipped scan's, and the passes over the
pieces behave as NOTES reports (APF exact from d_min in one pass; vanilla only near)."""

import jax
import jax.numpy as jnp
import numpy as np

import precond_linattn as pla
from benchmarks import pieces_model as pm
from benchmarks.bench_generate import model_for
from benchmarks.bench_osgm import make_inputs


def case(T, vanilla):
    """Two heads of ``bench_osgm``'s inputs (η = 0.003): (inputs, (s, w, g, r), d_1)."""
    x, _ = make_inputs(jax.random.PRNGKey(2), 1, T, 2, 128, jnp.bfloat16)
    *coefs, d1 = pm.coefficients_of(x, vanilla, 0.003)
    return x, coefs, d1


def test_scan_is_the_token_loop():
    """The model's float32 scan ends on the reference token loop's final d (to 1e-6), with
    APF retention and without."""
    for vanilla in (False, True):
        x, coefs, d1 = case(200, vanilla)
        f32 = {n: x[n].astype(jnp.float32) for n in ("k", "beta", "r")}
        _, want = pla.osgm_precondition(f32["k"], f32["beta"],
                                        retention=None if vanilla else f32["r"],
                                        initial_state=x["d0"], output_final_state=True,
                                        impl="reference")
        np.testing.assert_allclose(pm.scan(d1, *coefs)[0], np.asarray(want[0]), rtol=1e-6)


def test_affine_map_is_the_unclipped_scan():
    """Where no clip acts (96 tokens from states inside the box, with APF retention and
    without) M d + c is the float64 scan from any entering d, to 1e-12."""
    for vanilla in (True, False):
        _, coefs, d1 = case(96, vanilla)
        M, c = pm.affine_map(*coefs)
        for d in (d1, np.random.default_rng(0).uniform(1.2, 1.6, d1.shape)):
            got = np.einsum("hkj,hj->hk", M, d) + c
            want, clipped = pm.scan(d, *coefs, dtype=np.float64)
            assert clipped == 0
            np.testing.assert_allclose(got, want, rtol=1e-12)


def test_apf_pieces_settle_in_one_pass_from_the_floor():
    """APF over 3 pieces of 128 tokens: the retention brings d down onto d_min (half the
    coordinates sit there where the third piece starts), where the clip forgets the state it
    came from, so the second piece run from d_min gives the sequential state bit for bit in
    one pass; from d_1 (128 tokens do not bring it down that far) it takes the two of
    causality."""
    _, coefs, d1 = case(384, vanilla=False)
    pieces = pm.cut(coefs, 3)
    truth, _, clipped = pm.entering_states(d1, pieces)
    assert clipped > 0 and float(np.mean(truth[2] == pm.BOUNDS[0])) > 0.4
    floor = np.full(truth.shape, pm.BOUNDS[0], np.float32)
    assert pm.passes(floor, truth, pieces, d1)[1] == 1
    assert pm.passes(np.broadcast_to(d1, truth.shape), truth, pieces, d1)[1] == 2


def test_vanilla_pieces_need_the_composed_maps():
    """Vanilla over 4 pieces of 128 tokens: the composed maps give the entering states to within
    10x the float32 scan's own distance from a float64 one, d_1 is off by > 1e-3, and neither
    reaches the bits before the P − 1 passes of causality."""
    _, coefs, d1 = case(512, vanilla=True)
    pieces = pm.cut(coefs, 4)
    truth, exact, _ = pm.entering_states(d1, pieces)
    rounding = np.max(np.abs(exact - truth) / np.abs(truth))
    affine, _ = pm.passes(pm.composed_states(d1, pieces), truth, pieces, d1)
    start, _ = pm.passes(np.broadcast_to(d1, truth.shape), truth, pieces, d1)
    assert 0 < affine[0] <= 10 * rounding and start[0] > 1e-3
    assert affine[3] == start[3] == 0.0 and min(affine[2], start[2]) > 0


def test_layer_inputs_are_what_each_layer_scans():
    """A two-layer OSDN-APF model's prefill: one set of inputs a layer, and the model's scan of
    each ends on the d the prefill's cache holds (float32, to 1e-6)."""
    model = model_for("deltanet-340m", "osgm_apf", tiny=True)
    prompt = jax.random.randint(jax.random.PRNGKey(0), (1, 40), 0, model.config.vocab_size)
    seen, cache = pm.layer_inputs(model, prompt)
    assert len(seen) == model.config.num_layers == 2
    for (*coefs, d1), layer in zip(seen, cache.ordered()):
        np.testing.assert_allclose(pm.scan(d1, *coefs)[0], np.asarray(layer[1][0]), rtol=1e-6)
