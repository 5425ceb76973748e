"""The fused decode-step kernel (``pallas_kernels.decode_step``) against ``osgm_step`` then
``delta_rule_step`` in interpret mode, its CUDA lowering, and a layer's ``step`` through it.

Tolerances: the kernel and the ops do the same float32 arithmetic except the order of the sums
over K (⟨d, s⟩, Σ s, S̄ᵀ k, Sᵀ q), so results agree to float32 rounding (1e-5 relative to the
largest element); a bf16 output o may differ by one bf16 rounding (2⁻⁸ relative) where the two
float32 values fall on either side of a rounding boundary.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_close, run_python, triton_kernels_lowered_for_cuda
from pallas_kernels import decode_step as ds
from pallas_kernels.decode_step import Launch, OSGMStep, decode_step
from precond_linattn.layers import LayerConfig, OSGMConfig, PrecondDeltaAttention
from precond_linattn.ops.delta import delta_rule_step
from precond_linattn.ops.osgm import osgm_step

B, H = 2, 3
D_MIN, D_MAX = 0.7, 1.6
BF16_ULP = 2.0 ** -8

# preconditioner cases: (osgm: None, or (beta_aware, APF retention)), given write key
PRECONDS = {"none": (None, False), "write_key": (None, True), "osgm": ((True, False), False),
            "osgm_apf": ((True, True), False), "osgm_free": ((False, False), False),
            "osgm_free_apf": ((False, True), False)}


def make_inputs(rand, K, V, decay, precond, dtype=jnp.float32):
    """Random step inputs (never zero): unit q, k; S ~ N(0, 1); d in (0.5, 2) around the box
    [D_MIN, D_MAX] and eta = 1, so that the update pins some channels on each bound."""
    osgm, write_key = PRECONDS[precond]
    x = dict(q=rand.unit(B, H, K, dtype=dtype), k=rand.unit(B, H, K, dtype=dtype),
             v=rand.normal(B, H, V, dtype=dtype), beta=rand.beta(B, H, dtype=dtype),
             state=rand.normal(B, H, K, V),
             log_decay=None if decay is None else rand.log_decay(decay, B, 1, H, K)[:, 0])
    if write_key:
        x["write_key"] = rand.unit(B, H, K, dtype=dtype) * 1.3
    if osgm is not None:
        beta_aware, apf = osgm
        d = jnp.asarray(rand.rng.uniform(0.5, 2.0, (B, H, K)), jnp.float32)
        r = jnp.asarray(rand.rng.uniform(0.8, 1.0, (B, H)), jnp.float32) if apf else None
        x["osgm"] = OSGMStep(d, eta=1.0, d_min=D_MIN, d_max=D_MAX, retention=r, beta_aware=beta_aware)
    return x


def unfused(q, k, v, beta, state, log_decay=None, write_key=None, osgm=None):
    """(o, S, d) of ``osgm_step`` (when ``osgm``) then ``delta_rule_step``."""
    d = None
    if osgm is not None:
        write_key, d = osgm_step(k, beta, osgm.d, eta=osgm.eta, d_min=osgm.d_min, d_max=osgm.d_max,
                                 retention=osgm.retention, beta_aware=osgm.beta_aware, eps=osgm.eps)
    o, S = delta_rule_step(q, k, v, beta, state, write_key=write_key, log_decay=log_decay)
    return o, S, d


def assert_matches_unfused(x, o_tol, **options):
    """``decode_step`` on inputs ``x`` equals ``unfused``: o (dtype v's) within ``o_tol``, S and d
    within 1e-5; with OSGM the new d lies on each bound for some channels and strictly inside for
    others (the clip is exercised)."""
    o, S, d = decode_step(**x, interpret=True, **options)
    o_ref, S_ref, d_ref = unfused(**x)
    assert o.dtype == x["v"].dtype and S.dtype == jnp.float32
    assert_close(o.astype(jnp.float32), o_ref.astype(jnp.float32), o_tol, "o")
    assert_close(S, S_ref, 1e-5, "S")
    if d_ref is None:
        assert d is None
        return
    assert_close(d, d_ref, 1e-5, "d")
    d_ref = np.asarray(d_ref)
    assert (d_ref == D_MIN).any() and (d_ref == D_MAX).any()
    assert ((d_ref > D_MIN) & (d_ref < D_MAX)).any()


@pytest.mark.parametrize("decay, precond", [
    (None, "none"), ("scalar", "none"), ("vector", "none"), (None, "osgm"), ("scalar", "osgm_apf"),
    ("vector", "osgm_free"), (None, "osgm_free_apf"), ("vector", "osgm_apf"), ("scalar", "write_key"),
    ("vector", "write_key")])
def test_matches_ops(decay, precond, rand):
    """K = 32 ≠ V = 64 in two V tiles (block_v 32), B = 2 rows, H = 3 heads, float32."""
    assert_matches_unfused(make_inputs(rand, 32, 64, decay, precond), 1e-5, launch=Launch(32))


@pytest.mark.parametrize("precond", ["osgm_apf", "write_key"])
def test_padded_head_dims(precond, rand):
    """K = 24, V = 40 (not powers of two): zero-padded to 32 and 64, two V tiles, sliced back."""
    assert_matches_unfused(make_inputs(rand, 24, 40, "vector", precond), 1e-5, launch=Launch(32))


@pytest.mark.parametrize("precond", ["osgm_apf", "osgm_free", "none"])
def test_bf16_inputs(precond, rand):
    """bf16 q, k, v, β (float32 S, d): o in bf16; OSGM's k̃ rounded to bf16 as ``osgm_step`` does."""
    x = make_inputs(rand, 32, 32, "vector", precond, dtype=jnp.bfloat16)
    assert_matches_unfused(x, BF16_ULP, launch=Launch(16))


@pytest.mark.parametrize("decay, precond", [(None, "osgm"), ("scalar", "osgm_apf"), ("vector", "none"),
                                            (None, "write_key")])
def test_l2_norms_in_the_kernel(decay, precond, rand):
    """With ``normalize_eps`` the kernel L2-normalises q and k itself: unnormalised inputs (norms
    0.2 to 5 a head, never 1) give the unfused ops' results on the normalised ones (float32, K =
    24 padded to 32: the padding adds nothing to the norms)."""
    x = make_inputs(rand, 24, 40, decay, precond)
    size = lambda: jnp.asarray(rand.rng.uniform(0.2, 5.0, (B, H, 1)), jnp.float32)  # noqa: E731
    raw = dict(x, q=x["q"] * size(), k=x["k"] * size())
    o, S, d = decode_step(**raw, normalize_eps=1e-6, launch=Launch(16), interpret=True)
    o_ref, S_ref, d_ref = unfused(**x)  # x's q and k are unit vectors: what the norm gives
    assert_close(o, o_ref, 1e-5, "o")
    assert_close(S, S_ref, 1e-5, "S")
    if d_ref is not None:
        assert_close(d, d_ref, 1e-5, "d")
    o_raw, _, _ = decode_step(**raw, launch=Launch(16), interpret=True)
    assert float(jnp.max(jnp.abs(o_raw - o_ref))) > 1e-2  # without the norm: other results


def test_scale(rand):
    """An explicit query scale reaches o exactly as in ``delta_rule_step``."""
    x = make_inputs(rand, 16, 16, "scalar", "none")
    o, _, _ = decode_step(**x, scale=0.3, interpret=True)
    o_ref, _ = delta_rule_step(x["q"], x["k"], x["v"], x["beta"], x["state"],
                               log_decay=x["log_decay"], scale=0.3)
    assert_close(o, o_ref, 1e-5, "o")


def _pallas_call(fn):
    """The one pallas_call equation in the jaxpr of ``fn()`` (inside its jits)."""
    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                yield e
            for v in e.params.values():
                if hasattr(v, "jaxpr"):
                    yield from walk(v.jaxpr)
    [eqn] = walk(jax.make_jaxpr(fn)().jaxpr)
    return eqn


@pytest.mark.parametrize("K, V", [(32, 64), (24, 40)])
def test_two_slots_of_d_updated_in_place(K, V, rand):
    """With ``OSGMStep.slot`` the kernel reads row b's d from slot slot_b of d [B, H, 2, K] and
    writes d_new into the other slot, the slot it read left as it was, the whole buffer declared
    over its input (as S_new over S) while the launch keeps its V tiles (4 here). Random contents
    in both slots, the rows on different slots; a jitted loop of 3 steps alternating the slots
    equals the unfused ops step by step (K = 24, V = 40: padded heads)."""
    x = make_inputs(rand, K, V, None, "osgm_apf")
    pair = jnp.stack([x["osgm"].d, jnp.asarray(rand.rng.uniform(0.5, 2.0, (B, H, K)), jnp.float32)], 2)
    slot = jnp.asarray([1, 0], jnp.int32)
    here = dict(x, osgm=x["osgm"]._replace(d=pair, slot=slot))
    launch = Launch(16, 2)
    eqn = _pallas_call(lambda: decode_step(**here, launch=launch, interpret=True))
    names = ["q", "k", "v", "beta", "state", "d", "retention", "slot"]
    assert dict(eqn.params["input_output_aliases"]) == {names.index("state"): 0, names.index("d"): 2}
    assert eqn.params["grid_mapping"].grid[2] == 4
    o, S, d = decode_step(**here, launch=launch, interpret=True)
    rows = jnp.arange(B)
    current = pair[rows, :, slot]
    o_ref, S_ref, d_ref = unfused(**dict(x, osgm=x["osgm"]._replace(d=current)))
    assert d.shape == (B, H, 2, K)
    assert_close(o, o_ref, 1e-5, "o")
    assert_close(S, S_ref, 1e-5, "S")
    np.testing.assert_array_equal(d[rows, :, slot], current)
    assert_close(d[rows, :, 1 - slot], d_ref, 1e-5, "d_new")

    @jax.jit
    def loop(S, d):
        def body(t, carry):
            S, d = carry
            step = dict(x, state=S, osgm=x["osgm"]._replace(d=d, slot=(slot + t) % 2))
            return decode_step(**step, launch=launch, interpret=True)[1:]
        return jax.lax.fori_loop(0, 3, body, (S, d))

    S, d = loop(x["state"], pair)
    S_ref, d_ref = x["state"], current
    for _ in range(3):
        _, S_ref, d_ref = unfused(**dict(x, state=S_ref, osgm=x["osgm"]._replace(d=d_ref)))
    assert_close(S, S_ref, 1e-5, "S after 3 steps")
    assert_close(d[rows, :, (slot + 3) % 2], d_ref, 1e-5, "d after 3 steps")


@pytest.mark.parametrize("fields, match", [
    (dict(block_v=24), "block_v must be a power of two >= 16, got 24"),
    (dict(num_warps=3), "num_warps must be 1, 2, 4 or 8, got 3")])
def test_bad_launch(fields, match):
    with pytest.raises(ValueError, match=match):
        Launch(**fields)


def test_default_launch_reaches_calls_that_name_none(rand, monkeypatch):
    """``default_launch`` sets the V tile and warps of calls that name no launch (as the layers'
    ``step``); None keeps the enclosing one; the call's own launch wins; anything else is refused."""
    seen = []
    real = ds._call
    monkeypatch.setattr(ds, "_call", lambda kernel, inputs, BV, warps, interp: (
        seen.append((BV, warps)), real(kernel, inputs, BV, warps, interp))[1])
    x = make_inputs(rand, 16, 64, None, "none")
    with ds.default_launch(Launch(16, 2)):
        with ds.default_launch(None):
            decode_step(**x, interpret=True)
        decode_step(**x, launch=Launch(64, 1), interpret=True)
    decode_step(**x, interpret=True)
    assert seen == [(16, 2), (64, 1), (32, 4)]
    with pytest.raises(ValueError, match="default_launch"):
        with ds.default_launch(dict(block_v=16)):
            pass


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.ones((B, H, 16, 1))), r"q must have shape \[B, H, K\]"),
    (dict(k=jnp.ones((B, H, 8))), r"k must have shape \[B, H, K\]"),
    (dict(v=jnp.ones((B, 2, 16))), r"v must have shape \[B, H, V\]"),
    (dict(beta=jnp.ones((B,))), r"beta must have shape \[B, H\]"),
    (dict(state=jnp.ones((B, H, 16, 8))), r"state must have shape \[B, H, K, V\]"),
    (dict(state=jnp.ones((B, H, 16, 16), jnp.bfloat16)), "state must be float32"),
    (dict(log_decay=jnp.ones((B, H, 4))), r"log_decay must be None, \[B, H\] or \[B, H, K\]"),
    (dict(write_key=jnp.ones((B, H, 8))), r"write_key must have shape \[B, H, K\]"),
    (dict(write_key=jnp.ones((B, H, 16)), osgm=OSGMStep(jnp.ones((B, H, 16)), 0.1, 0.5, 2.0)),
     "give write_key or osgm, not both"),
    (dict(osgm=(1.0, 0.5, 2.0)), "osgm must be an OSGMStep"),
    (dict(osgm=OSGMStep(jnp.ones((B, H, 8)), 0.1, 0.5, 2.0)), r"osgm.d must have shape \[B, H, K\]"),
    (dict(osgm=OSGMStep(jnp.ones((B, H, 16)), 0.1, 0.5, 2.0, retention=jnp.ones((B, H, 1)))),
     r"osgm.retention must have shape \[B, H\]"),
    (dict(osgm=OSGMStep(jnp.ones((B, H, 16)), 0.1, 2.0, 0.5)), "osgm.d_max must be >= osgm.d_min"),
    (dict(osgm=OSGMStep(jnp.ones((B, H, 16)), 0.1, 0.5, 2.0, slot=jnp.zeros((B,), jnp.int32))),
     r"osgm.d must have shape \[B, H, 2, K\] \(two slots, with osgm.slot\)"),
    (dict(osgm=OSGMStep(jnp.ones((B, H, 2, 16), jnp.bfloat16), 0.1, 0.5, 2.0,
                        slot=jnp.zeros((B,), jnp.int32))),
     "osgm.d must be float32 with osgm.slot"),
    (dict(osgm=OSGMStep(jnp.ones((B, H, 2, 16)), 0.1, 0.5, 2.0, slot=jnp.zeros((B, 1), jnp.int32))),
     r"osgm.slot must have shape \[B\]"),
    (dict(osgm=OSGMStep(jnp.ones((B, H, 2, 16)), 0.1, 0.5, 2.0, slot=jnp.zeros((B,)))),
     "osgm.slot must be an integer array"),
    (dict(scale=float("nan")), "scale must be a finite scalar"),
    (dict(normalize_eps=-1.0), "normalize_eps must be >= 0"),
    (dict(launch=(32, 4)), "launch must be a decode_step.Launch"),
])
def test_errors(change, match):
    """Bad arguments raise a ValueError naming the argument."""
    x = dict(q=jnp.ones((B, H, 16)), k=jnp.ones((B, H, 16)), v=jnp.ones((B, H, 16)),
             beta=jnp.ones((B, H)), state=jnp.ones((B, H, 16, 16)))
    with pytest.raises(ValueError, match=match):
        decode_step(**{**x, **change}, interpret=True)


def test_traced_hyper_parameter_is_an_error():
    """OSGM's hyper-parameters are compiled into the kernel: a traced one is a clear error."""
    x = dict(q=jnp.ones((B, H, 16)), k=jnp.ones((B, H, 16)), v=jnp.ones((B, H, 16)),
             beta=jnp.ones((B, H)), state=jnp.ones((B, H, 16, 16)))
    with pytest.raises(ValueError, match="osgm.eta must be a Python number"):
        jax.jit(lambda eta: decode_step(**x, osgm=OSGMStep(jnp.ones((B, H, 16)), eta, 0.5, 2.0),
                                        interpret=True))(0.1)


@pytest.mark.parametrize("decay, precond, slots", [
    ("vector", "osgm_apf", False), ("scalar", "write_key", False), (None, "none", False),
    (None, "osgm", True)])
def test_lowers_for_cuda(decay, precond, slots):
    """The step lowers for CUDA as one Triton kernel (K = V = 128, bf16, 2 V tiles of 64); with
    OSGM's two slots of d and the L2 norms of q and k too (as the layers' step runs it)."""
    K, V = 128, 128
    osgm, write_key = PRECONDS[precond]
    shapes = dict(q=(B, H, K), k=(B, H, K), v=(B, H, V), beta=(B, H), state=(B, H, K, V))
    if decay is not None:
        shapes["log_decay"] = (B, H) if decay == "scalar" else (B, H, K)
    if write_key:
        shapes["write_key"] = (B, H, K)
    if osgm is not None:
        shapes.update(d=(B, H, 2, K) if slots else (B, H, K), retention=(B, H))
    if slots:
        shapes["slot"] = (B,)
    names = list(shapes)

    def step(*args):
        x = dict(zip(names, args))
        if osgm is not None:
            x["osgm"] = OSGMStep(x.pop("d"), 0.003, 0.5, 2.0, retention=x.pop("retention"),
                                 slot=x.pop("slot", None))
        return decode_step(**x, launch=Launch(64), normalize_eps=1e-6 if slots else None,
                           interpret=False)

    dtypes = dict(q=jnp.bfloat16, k=jnp.bfloat16, v=jnp.bfloat16, write_key=jnp.bfloat16, slot=jnp.int32)
    args = [jax.ShapeDtypeStruct(s, dtypes.get(n, jnp.float32)) for n, s in shapes.items()]
    assert triton_kernels_lowered_for_cuda(step, args, grad=False) == 1


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from pallas_kernels import decode_step as ds
from pallas_kernels.decode_step import Launch, OSGMStep, decode_step
mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
rng = np.random.default_rng(0)
x = [jnp.asarray(rng.uniform(0.1, 1.0, s), jnp.float32)
     for s in ((4, 4, 16), (4, 4, 16), (4, 4, 32), (4, 4), (4, 4, 16, 32), (4, 4, 16), (4, 4), (4, 4, 16))]
f = lambda q, k, v, beta, S, d, r, g: decode_step(q, k, v, beta, S, log_decay=-g,
                                                  osgm=OSGMStep(d, 1.0, 0.7, 1.6, retention=r))
put = [jax.device_put(a, NamedSharding(mesh, P("data", "model"))) for a in x]
step = jax.jit(f)
assert "all-gather" not in step.lower(*put).compile().as_text()
for got, want in zip(step(*put), f(*x)):
    np.testing.assert_array_equal(got, want)
    assert got.sharding.spec[:2] == ("data", "model")
print("ok")
"""


def test_sharded_rows_and_heads():
    """Inside a jit over a 2 x 2 mesh (4 fake CPU devices) rows and heads stay sharded (no
    all-gather) and every shard's result is the unsharded one, bit for bit."""
    run_python("-c", SHARDED, devices=4, timeout=120, ends_with="ok")


def test_config_selects_the_fused_step():
    """``fused_decode`` None follows impl: the kernel for "pallas", the two ops for "chunked" /
    "reference" and for "auto" on this CPU; True / False force it; anything else is an error."""
    def fused(**kw):
        return PrecondDeltaAttention(LayerConfig(16, 1, **kw), rngs=nnx.Rngs(0))._fused_decode()

    assert fused(impl="pallas") and fused(impl="chunked", fused_decode=True)
    assert not any((fused(impl="auto"), fused(impl="chunked"), fused(impl="reference"),
                    fused(impl="pallas", fused_decode=False)))
    with pytest.raises(ValueError, match="fused_decode must be None or a bool, got 1"):
        LayerConfig(16, 1, fused_decode=1)


@pytest.mark.parametrize("backbone, pre", [("deltanet", "osgm"), ("deltanet", "osgm_apf"),
                                           ("gdn", "osgm"), ("kda", "osgm_apf"), ("deltanet", "none"),
                                           ("gdn", "atk")])
def test_layer_step_fused_matches_unfused(backbone, pre, rand):
    """A layer's ``step`` through the kernel (``fused_decode=True``, interpret mode) gives the
    outputs and cache of the two ops, over three tokens after a 5-token prefill (float32; OSGM with
    eta = 0.5 and a narrow box so that d moves and pins)."""
    osgm = OSGMConfig(eta=0.5, d_min=0.8, d_max=1.3) if pre.startswith("osgm") else None
    c = LayerConfig(32, 2, backbone=backbone, preconditioner=pre, dtype=jnp.float32, osgm=osgm,
                    impl="chunked", chunk_size=4, fused_decode=False)
    layers = [PrecondDeltaAttention(dataclasses.replace(c, fused_decode=f), rngs=nnx.Rngs(4))
              for f in (False, True)]
    x = rand.normal(B, 8, 32)
    _, cache = nnx.jit(type(layers[0]).prefill)(layers[0], x[:, :5])
    caches = [cache, cache]
    step = nnx.jit(PrecondDeltaAttention.step)
    for t in range(5, 8):
        (y, cache), (y_fused, cache_fused) = (step(m, x[:, t], c) for m, c in zip(layers, caches))
        assert_close(y_fused, y, 1e-5, f"y at token {t}")
        for a, b in zip(jax.tree.leaves(cache_fused), jax.tree.leaves(cache)):
            assert_close(a, b, 1e-5, f"cache at token {t}")
        caches = [cache, cache_fused]
    # the kernel took over q's and k's L2 norms (ATK's step needs k normalised before it)
    rsqrts = [_outside_kernels(lambda: nnx.merge(*nnx.split(m)).step(x[:, 5], cache), "rsqrt")
              for m in layers]
    assert rsqrts[0] - rsqrts[1] == (0 if pre == "atk" else 2)


def _outside_kernels(fn, primitive):
    """How many ``primitive`` equations the jaxpr of ``fn()`` has outside its pallas_calls."""
    def count(jaxpr):
        n = 0
        for e in jaxpr.eqns:
            n += e.primitive.name == primitive
            if e.primitive.name != "pallas_call":
                n += sum(count(v.jaxpr) for v in e.params.values() if hasattr(v, "jaxpr"))
        return n
    return count(jax.make_jaxpr(fn)().jaxpr)
