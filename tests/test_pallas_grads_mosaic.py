"""grads_mosaic.chunk_grads_fused in interpret mode (its dots as jnp.dot of the same bf16
operands) against chunk_pullback's float32 algebra on the same bf16 inputs."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (assert_repeats_bitwise, assert_vmap_matches_loop,
                      mosaic_kernels_lowered_for_cuda)
from test_pallas_precision import (assert_within_fla_bars, kernel_runs, packed_documents_runs, rel_rms)


from pallas_kernels.chunk_pullback import backward_inputs, chunk_pullback
from pallas_kernels import delta_rule, state_mosaic
from pallas_kernels.delta_rule import Options, delta_rule_pallas, resolve
from pallas_kernels.grads_mosaic import check_shapes, chunk_grads_fused

C, SCALE = 64, 0.3


def case(seed, B, H, nc, K, V, decay):
    """bf16 kernel inputs and the float32 values they hold: unit q, k; k̃ = d ⊙ k, d in [0.5, 2];
    β in (0.05, 0.95); g = log σ(x + 4) or 0; random chunk-start states and chunk-end cotangents;
    T, R and dR formed from those (float32) as the forward and the state passes would."""
    rng = np.random.default_rng(seed)
    Tp = nc * C
    bf = lambda x: jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    k = unit(rng.standard_normal((B, Tp, H, K)))
    x = dict(q=bf(unit(rng.standard_normal((B, Tp, H, K)))), k=bf(k),
             kw=bf(k * rng.uniform(0.5, 2.0, (B, Tp, H, K))), v=bf(rng.standard_normal((B, Tp, H, V))),
             do=bf(rng.standard_normal((B, Tp, H, V))),
             beta=jnp.asarray(rng.uniform(0.05, 0.95, (B, Tp, H)), jnp.float32),
             g=jnp.asarray(np.log(1 / (1 + np.exp(-rng.standard_normal((B, Tp, H)) - 4)))
                           if decay else np.zeros((B, Tp, H)), jnp.float32),
             S=bf(rng.standard_normal((B, H, nc, K, V))), dS=bf(rng.standard_normal((B, H, nc, K, V))))
    f = {n: a.astype(jnp.float32) for n, a in x.items()}

    def per_chunk(b, h, c):
        rows = slice(c * C, (c + 1) * C)
        return [f[n][b, rows, h] for n in ("q", "k", "kw", "v", "beta", "g", "do")] + [
            f["S"][b, h, c], f["dS"][b, h, c]]

    T, R, dR = (np.zeros(s, np.float32) for s in ((B, H, Tp, C), (B, H, Tp, V), (B, H, Tp, V)))
    want = []
    for b in range(B):
        for h in range(H):
            for c in range(nc):
                q, k_, kw, v, beta, g, do, S, dS = per_chunk(b, h, c)
                rows = slice(c * C, (c + 1) * C)
                T[b, h, rows], R[b, h, rows], dR[b, h, rows] = backward_inputs(
                    q, k_, kw, v, beta, g, S, do, dS, SCALE)
                want.append(((b, h, rows), chunk_pullback(q, k_, kw, v, beta, g, S, do, dS,
                                                          SCALE)))
    ins = dict(q=x["q"], k=x["k"], kw=x["kw"], v=x["v"], do=x["do"], T=jnp.asarray(T),
               beta=x["beta"], gamma=jnp.cumsum(x["g"].reshape(B, nc, C, H), 2).reshape(B, Tp, H),
               R=bf(R), dR=bf(dR), states=jnp.swapaxes(x["S"], -1, -2),
               dstates=jnp.swapaxes(x["dS"], -1, -2))
    return ins, want


@pytest.mark.parametrize("K, V, decay, warpgroups", [(64, 64, True, 1), (128, 64, False, 1),
                                                     (64, 64, True, 2), (128, 64, False, 2)])
def test_matches_the_float32_pullback(K, V, decay, warpgroups):
    """Two heads, two chunks, in one warpgroup or two: dq, dk, dk̃, dv, dβ and dg (dG
    reverse-summed in each chunk) within 8e-3 relative RMS of ``chunk_pullback`` (FLA's bar for
    bf16 gradients; measured 1.6e-3 to 4.3e-3: the kernel's inputs, R and dR, and its products
    Diag(β) X, dX, dT, Tᵀ dT, G_K and G_Q are rounded to bf16, each ~2^-9 relative)."""
    ins, want = case(0, 1, 2, 2, K, V, decay)
    dq, dk, dkw, dv, db, dG = chunk_grads_fused(**ins, scale=SCALE, interpret=True,
                                                warpgroups=warpgroups)
    B, Tp, H = ins["beta"].shape
    dg = jnp.flip(jnp.cumsum(jnp.flip(dG.reshape(B, Tp // C, C, H), 2), 2), 2).reshape(B, Tp, H)
    got = dict(q=dq, k=dk, kw=dkw, v=dv, beta=db, g=dg)
    names = ("q", "k", "kw", "v", "beta") + (("g",) if decay else ())
    for n_i, name in enumerate(names):
        a = jnp.concatenate([got[name][b, rows, h].astype(jnp.float32).ravel()
                             for (b, h, rows), _ in want])
        w = jnp.concatenate([g[n_i].ravel() for _, g in want])
        err = rel_rms(a, w)
        assert err <= 8e-3, f"d{name}: relative RMS {err:.3g}"


def test_two_warpgroups_give_the_same_bits():
    """The two chains in a warpgroup each (their partial dβ and dG passed through shared
    memory, after barriers) give bitwise the results of one warpgroup running both."""
    ins, _ = case(1, 1, 2, 2, 64, 64, True)
    one, two = (chunk_grads_fused(**ins, scale=SCALE, interpret=True, warpgroups=n)
                for n in (1, 2))
    for a, b in zip(one, two):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_refuses_what_it_cannot_take():
    for kw, match in ((dict(chunk=32, K=64, V=64, dtype=jnp.bfloat16), "chunk_size"),
                      (dict(chunk=64, K=96, V=64, dtype=jnp.bfloat16), "head dim K"),
                      (dict(chunk=64, K=64, V=256, dtype=jnp.bfloat16), "head dim V"),
                      (dict(chunk=64, K=64, V=64, dtype=jnp.float16), "bfloat16")):
        with pytest.raises(ValueError, match=match):
            check_shapes(**kw)


MOSAIC = Options(serial_backend="mosaic", fused_grads=False)
FUSED_GRADS = Options(serial_backend="mosaic", fused_grads=True, wy_in_serial=False)  # W, U via HBM


@pytest.mark.parametrize("decay", [None, "scalar"])
def test_op_with_fused_grads_within_fla_bars(rand, decay, monkeypatch):
    """The op with ``fused_grads``, its kernel in two warpgroups (one gives the same bits,
    above; T = 150: two chunks and a tail; K = 40 and V = 48 padded to 64; an initial state):
    outputs, final state and every gradient within FLA's bars of the float32 reference, and
    within 6e-3 of the Mosaic pipeline without it (``chunk_grads`` then ``wy_bwd``: the same
    algebra, rounded at other places); the initial state's gradient, from the state pass both
    share, identical; the fused kernel ran once, for the backward, on T as ``wy_fwd`` stored it
    for it, in bf16 (test_sequence_split has it with the passes in sequence pieces)."""
    calls = []
    monkeypatch.setattr(delta_rule, "chunk_grads_fused",
                        lambda **kw: calls.append(kw["T"].dtype) or chunk_grads_fused(**kw))
    fused, unfused, ref = kernel_runs(rand, decay, 7, FUSED_GRADS, MOSAIC, K=40)
    assert calls == [jnp.bfloat16]
    assert_within_fla_bars(fused, ref)
    for name in ref[2]:
        assert rel_rms(fused[2][name], unfused[2][name]) <= 6e-3, name
    np.testing.assert_array_equal(fused[2]["s0"], unfused[2]["s0"])


def test_fused_grads_packed_documents(rand):
    """Three packed documents (64, 1 and 85 tokens) with per-document initial states and a scalar
    decay: outputs, final states and every gradient within FLA's bars of the float32 reference
    (the kernel takes each chunk's start state and end cotangent from the passes, which restart
    at the documents' chunks)."""
    assert_within_fla_bars(*packed_documents_runs(rand, FUSED_GRADS))


def test_fused_grads_refuses_what_it_cannot_run(rand):
    """fused_grads without the Mosaic passes, with a per-channel decay or with float16 inputs: a
    ValueError naming what it needs."""
    x = rand.delta_inputs(1, 64, 1, 64, 64, decay="vector", dtype=jnp.bfloat16)

    def call(options, log_decay, dtype=jnp.bfloat16):
        q, k, kw, v = (x[n].astype(dtype) for n in ("q", "k", "write_key", "v"))
        return delta_rule_pallas(q, k, kw, v, x["beta"], log_decay, 0.125, None, None, 64,
                                 options)

    with pytest.raises(ValueError, match="serial_backend='mosaic'"):
        call(Options(serial_backend="triton", fused_grads=True), None)
    with pytest.raises(ValueError, match="scalar decay"):
        call(FUSED_GRADS, x["log_decay"])
    with pytest.raises(ValueError, match="bfloat16"):
        call(FUSED_GRADS, None, jnp.float16)
    with pytest.raises(ValueError, match="grads_warpgroups must be 1 or 2"):
        Options(grads_warpgroups=3)


def test_fused_grads_by_default_where_it_applies(rand, monkeypatch):
    """``fused_grads=None`` resolves to True with the Mosaic passes where the kernel applies (bf16
    inputs, no or a scalar decay, shapes it takes) and to False elsewhere; an explicit value
    stays. The op works out where it applies from its inputs: traced as on a Hopper GPU
    (``state_mosaic.runs_here`` True), it resolves True for bf16 with a scalar decay and K = 40
    (padded to 64), False for a per-channel decay, float16, or V = 150 (padded to 256: the
    Mosaic passes take it, this kernel does not)."""
    def picked(options, **kw):
        kw = {"sixteen_bit": True, "mosaic_fits": True, "grads_fit": True} | kw
        return resolve(options, **kw).fused_grads

    assert picked(Options()) is True
    assert picked(Options(), grads_fit=False) is False
    assert picked(Options(), mosaic_fits=False) is False  # the Triton passes
    assert picked(Options(serial_backend="triton")) is False
    assert picked(Options(fused_grads=False)) is False
    assert picked(Options(fused_grads=True), grads_fit=False) is True  # the op raises then

    resolved = []
    monkeypatch.setattr(delta_rule, "resolve",
                        lambda *a, **kw: resolved.append(resolve(*a, **kw)) or resolved[-1])
    monkeypatch.setattr(state_mosaic, "runs_here", lambda **kw: state_mosaic.fits(
        chunk=kw["chunk"], K=kw["K"], V=kw["V"]))

    def fused(V=48, decay="scalar", dtype=jnp.bfloat16):
        x = rand.delta_inputs(1, 100, 2, 40, V, decay=decay, dtype=dtype)
        jax.eval_shape(lambda: delta_rule_pallas(
            x["q"], x["k"], x["write_key"], x["v"], x["beta"], x["log_decay"], 0.125, None, None,
            64, Options(), interpret=True))
        return resolved[-1].serial_backend == "mosaic" and resolved[-1].fused_grads

    assert fused() and fused(decay=None)
    assert not fused(decay="vector")
    assert not fused(dtype=jnp.float16)
    assert not fused(V=150)


def arg_shapes(B, H, nc, K, V):
    """ShapeDtypeStructs of ``chunk_grads_fused``'s arguments, in order."""
    S, bf, f32, Tp = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, nc * C
    return ([S((B, Tp, H, K), bf)] * 3 + [S((B, Tp, H, V), bf)] * 2
            + [S((B, H, Tp, C), f32), S((B, Tp, H), f32), S((B, Tp, H), f32)]
            + [S((B, H, Tp, V), bf)] * 2 + [S((B, H, nc, V, K), bf)] * 2)


@pytest.mark.parametrize("K, V, warpgroups", [(128, 128, 1), (128, 64, 1), (128, 128, 2)])
def test_lowers_for_cuda(K, V, warpgroups):
    """The kernel goes through Mosaic GPU's lowering for CUDA on the CPU (layout inference, which
    interpret mode does not run: loading one buffer in two layouts failed there)."""
    fn = lambda *a: chunk_grads_fused(*a, scale=0.1, interpret=False,  # noqa: E731
                                      warpgroups=warpgroups)
    assert mosaic_kernels_lowered_for_cuda(fn, arg_shapes(1, 2, 2, K, V)) == 1


def test_fused_grads_under_vmap_repeat_bitwise_and_effect_free(rand):
    """Gradients of a loss of the op with ``fused_grads``: ``jax.vmap`` over rows as [1, T]
    sequences equals the rows one by one, and a second run (compiled afresh) is bitwise the
    first; traced for the GPU (not interpret mode) the kernel carries no effects, so
    ``jax.checkpoint`` and ``custom_partitioning`` take it there (test_pallas_mosaic says why
    interpret mode cannot show remat)."""
    x = rand.delta_inputs(2, 100, 2, 64, 64, decay="scalar", dtype=jnp.bfloat16)
    names = ("q", "k", "write_key", "v", "beta", "log_decay")

    def loss(*args):
        o, final = delta_rule_pallas(*args, 0.125, None, None, 64, FUSED_GRADS)
        return jnp.sum(jnp.sin(o.astype(jnp.float32))) + jnp.sum(final ** 2)

    grad = jax.grad(loss, argnums=tuple(range(6)))
    args = [x[n] for n in names]
    assert_vmap_matches_loop(grad, [a.reshape(2, 1, *a.shape[1:]) for a in args])
    assert_repeats_bitwise(lambda: jax.jit(grad)(*args))
    traced = jax.make_jaxpr(lambda *a: chunk_grads_fused(*a, scale=0.1, interpret=False))(
        *arg_shapes(1, 1, 1, 64, 64))
    assert not traced.effects
