"""The attention layer of all twelve variants (backbone × preconditioner), Flax NNX.

Per token x_t (the layer input), heads h = 1..H, key size K, value size V:

    q, k, v  = SiLU(ShortConv(x W_q)), SiLU(ShortConv(x W_k)), SiLU(ShortConv(x W_v))
    q, k     ← q / ‖q‖, k / ‖k‖ (per head)
    β_t      = σ(x W_b)  (× 2 with allow_neg_eigval)
    g_t      = none (DeltaNet) | −exp(A_log) softplus(x W_a + dt_bias) (GDN, [H])
               | −exp(A_log_h) softplus(x W_f1 W_f2 + dt_bias) (KDA, [H, K])
    k̃_t      = k_t | OSGM: d_t ⊙ k_t, r_t = σ(x W_r + b_r) with APF (SPEC 3.1)
               | ATK: B(A_t) ⊙ k_t, A_t = exp(g^P_t) A_{t−1} + β^P_t k_t², g^P_t = −exp(A_log_atk)
                 softplus(x W_a^P + dt_bias_atk), β^P_t = σ(x W_b^P), centre log_atk_scale (SPEC 3.2)
    o_t      = delta rule (SPEC 2) with read key k, write key k̃, decay g, scale K^−1/2
    y_t      = [RMSNorm_h(o_t) ⊙ act(x W_g)] W_o       (gate: DeltaNet optional, SiLU; GDN SiLU;
                                                        KDA low-rank x W_g1 W_g2 + b, sigmoid)

A decode ``step`` runs the preconditioner's step and the delta step either as the two ops
(``osgm_step`` / ``atk_step``, ``delta_rule_step``) or, on the Pallas path (``LayerConfig.
fused_decode``), as one kernel ``pallas_kernels.decode_step`` (ATK's k̃ still from ``atk_step``).
Every part of the cache is updated in place, so a jitted decoding loop copies nothing a step:
the convolution tails are rings and OSGM's d has two slots (current at ``position`` mod 2, the
next written into the other), both turned by the cache's ``position`` (``LayerCache``).

Parameter names follow FLA 0.6.0 (``fla/layers/{delta_net,gated_deltanet,kda,
precond_gated_deltanet,precond_kda}.py``) with Flax's leaf names; converting a checkpoint is:

    FLA                                   here                                  layout
    X.weight (nn.Linear)                  X.kernel                              transposed [in, out]
    X.bias                                X.bias
    X.{i}.weight (nn.Sequential)          X.layers.{i}.kernel                   transposed
    {q,k,v}_conv1d.weight [D, 1, W]       {q,k,v}_conv1d.kernel [W, D]          w[:, 0, :].T
    o_norm.weight                         o_norm.scale
    A_log, dt_bias, A_log_atk, dt_bias_atk, log_atk_scale                        same
    PrecondKDA a_proj (the ATK gate)      a_atk_proj                            (KDA has no a_proj)

OSDN has no FLA layer; its extra parameters are ``log_d_init`` [H] (learnable initial scale,
d_1 = exp(log_d_init), zero at init; with ``learn_init_scale``) and ``retention_proj`` (APF gate,
kernel [D, H], bias [H] = logit(init_retention)).
"""

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import decode_step
from precond_linattn._typing import Array, Float, Int
from precond_linattn.layers.config import LayerConfig
from precond_linattn.layers.conv import ShortConvolution, ring_order
from precond_linattn.layers.init import a_log_init, dt_bias_init, normal
from precond_linattn.layers.norm import RMSNorm
from precond_linattn.layout import row_major
from precond_linattn.ops.atk import atk_precondition, atk_step
from precond_linattn.ops.delta import delta_rule, delta_rule_step
from precond_linattn.ops.dispatch import choose_impl
from precond_linattn.ops.osgm import osgm_precondition, osgm_step


class LayerCache(NamedTuple):
    """Decode state of one layer, one row per sequence (document). ``position``: the tokens each
    row has stepped since the cache was laid out (``prefill`` / ``init_cache``: 0); it turns the
    convolution tails' rings (``ShortConvolution.step``) and OSGM's two slots of d, so that a
    step writes each in place (``ordered`` gives the contents in plain order)."""

    memory: Float[Array, "n h k v"]            # S, float32
    precond: Float[Array, "n h ..."] | None    # OSGM: d in two slots [N, H, 2, K], current at
                                                # position mod 2; ATK: A [N, H, K]; float32
    conv: tuple                                 # (q, k, v) tail rings [N, W, dim], compute dtype
    position: Int[Array, " n"]                 # int32

    def ordered(self):
        """(S, the preconditioner state [N, H, K] (OSGM's current d) or None, the (q, k, v)
        tails [N, W − 1, dim], oldest first): the cache's contents whatever its position."""
        precond = self.precond
        if precond is not None and precond.ndim == 4:
            precond = _current_slot(precond, self.position)[1]
        tails = tuple(ring_order(t, self.position, t.shape[1] - 1) for t in self.conv)
        return self.memory, precond, tails


def _current_slot(slots, position):
    """(the mask [N, 1, 2, 1] of each row's current slot, position mod 2, and OSGM's d [N, H, K]
    read from it). An elementwise select, not a gather: a decoding loop then writes the next d
    into the other slot in place (a gather before a scatter of the same buffer copies it)."""
    mask = (jnp.arange(2) == (position % 2)[:, None])[:, None, :, None]
    return mask, jnp.sum(jnp.where(mask, slots, 0), 2)


def _slots(d):
    """OSGM's d [N, H, K] as the cache's two slots [N, H, 2, K], current in slot 0 (the other's
    contents are never read before they are written)."""
    return jnp.stack([d, d], axis=2)


L2_EPS = 1e-6  # q, k ← x / sqrt(Σ x² + L2_EPS)


def _l2norm(x, eps=L2_EPS):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _softplus_decay(a, A_log, dt_bias):
    """g = −exp(A_log) softplus(a + dt_bias) ≤ 0, in float32."""
    return -jnp.exp(A_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)


class PrecondDeltaAttention(nnx.Module):
    def __init__(self, config: LayerConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        D, H, K, Vh = c.hidden_size, c.num_heads, c.head_k_dim, c.head_v_dim

        def lin(i, o, use_bias=False, **kw):
            return nnx.Linear(i, o, use_bias=use_bias, dtype=c.dtype, param_dtype=c.param_dtype,
                              kernel_init=normal, rngs=rngs, **kw)

        conv = lambda d: ShortConvolution(d, c.conv_size, use_bias=c.conv_bias, dtype=c.dtype,
                                          param_dtype=c.param_dtype, rngs=rngs)
        param = lambda init, shape: nnx.Param(init(rngs.params(), shape, c.param_dtype))
        self.q_proj, self.k_proj, self.v_proj = lin(D, c.key_dim), lin(D, c.key_dim), lin(D, c.value_dim)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(c.key_dim), conv(c.key_dim), conv(c.value_dim)
        self.b_proj = lin(D, H)
        a_lower = 1.0 if c.backbone == "kda" else 0.0
        if c.backbone == "gdn":
            self.a_proj = lin(D, H)
            self.A_log, self.dt_bias = param(a_log_init(a_lower), (H,)), param(dt_bias_init, (H,))
        elif c.backbone == "kda":
            self.f_proj = nnx.Sequential(lin(D, Vh), lin(Vh, H * K))
            self.A_log, self.dt_bias = param(a_log_init(a_lower), (H,)), param(dt_bias_init, (H * K,))
        if c.preconditioner == "atk":
            self.a_atk_proj, self.b_atk_proj = lin(D, H), lin(D, H)
            self.A_log_atk, self.dt_bias_atk = param(a_log_init(a_lower), (H,)), param(dt_bias_init, (H,))
            self.log_atk_scale = nnx.Param(jnp.full((H,), c.atk_options.center_init, c.param_dtype))
        elif c.preconditioner.startswith("osgm"):
            if c.osgm_options.learn_init_scale:
                self.log_d_init = nnx.Param(jnp.zeros((H,), c.param_dtype))
            if c.preconditioner == "osgm_apf":
                r0 = c.osgm_options.init_retention
                logit = nnx.initializers.constant(math.log(r0 / (1.0 - r0)))
                self.retention_proj = lin(D, H, use_bias=True, bias_init=logit)
        if c.backbone == "kda":
            self.g_proj = nnx.Sequential(lin(D, Vh), lin(Vh, c.value_dim, use_bias=True))
        elif c.gated:
            self.g_proj = lin(D, c.value_dim)
        activation = ("sigmoid" if c.backbone == "kda" else "swish") if c.gated else None
        self.o_norm = RMSNorm(Vh, eps=c.norm_eps, activation=activation, dtype=c.dtype,
                              param_dtype=c.param_dtype)
        self.o_proj = lin(c.value_dim, D)

    # ---- per-token parts (any leading dims [..., D]) ----

    def _input_linears(self):
        """The layer's Linear(D, ·) maps applied to x itself, by name (first layers of the
        low-rank KDA maps ``f_proj`` / ``g_proj``)."""
        c = self.config
        names = ["q_proj", "k_proj", "v_proj", "b_proj"]
        names += {"gdn": ["a_proj"], "kda": ["f_proj"]}.get(c.backbone, [])
        names += {"atk": ["a_atk_proj", "b_atk_proj"], "osgm_apf": ["retention_proj"]}.get(
            c.preconditioner, [])
        names += ["g_proj"] if c.gated else []
        first = lambda m: m.layers[0] if isinstance(m, nnx.Sequential) else m  # noqa: E731
        return {n: first(getattr(self, n)) for n in names}

    def _project(self, x):
        """All input projections in one matmul, y_n = x W_n + b_n for every map n of
        ``_input_linears``: x [..., D] @ [W_q | W_k | …] then split (one kernel instead of up to
        nine, which matters for one-token decode steps). Same dtypes as ``nnx.Linear``."""
        c = self.config
        mods = self._input_linears()
        W = jnp.concatenate([m.kernel[...] for m in mods.values()], axis=1).astype(c.dtype)
        y = jnp.dot(x.astype(c.dtype), W)
        if any(m.bias is not None for m in mods.values()):
            y = y + jnp.concatenate([jnp.zeros(m.kernel.shape[1], c.param_dtype) if m.bias is None
                                     else m.bias[...] for m in mods.values()]).astype(c.dtype)
        sizes = [m.kernel.shape[1] for m in mods.values()]
        parts = jnp.split(y, list(itertools.accumulate(sizes))[:-1], axis=-1)
        return dict(zip(mods, parts))

    def _gates(self, p):
        """β, the memory's decay g, and the preconditioner's per-token inputs, all float32, from
        the input projections ``p``."""
        c = self.config
        H, K = c.num_heads, c.head_k_dim
        beta = jax.nn.sigmoid(p["b_proj"].astype(jnp.float32)) * (2.0 if c.allow_neg_eigval else 1.0)
        g = None
        if c.backbone == "gdn":
            g = _softplus_decay(p["a_proj"], self.A_log[...], self.dt_bias[...])
        elif c.backbone == "kda":
            f = self.f_proj.layers[1](p["f_proj"]).reshape(*p["f_proj"].shape[:-1], H, K)
            g = _softplus_decay(f, self.A_log[...][:, None], self.dt_bias[...].reshape(H, K))
        pre = {}
        if c.preconditioner == "atk":
            pre = dict(log_decay=_softplus_decay(p["a_atk_proj"], self.A_log_atk[...],
                                                 self.dt_bias_atk[...]),
                       gain=jax.nn.sigmoid(p["b_atk_proj"].astype(jnp.float32)))
        elif c.preconditioner == "osgm_apf":
            pre = dict(retention=jax.nn.sigmoid(p["retention_proj"].astype(jnp.float32)))
        return beta, g, pre

    def _convolve(self, convs, xs, cu_seqlens):
        """The q, k, v short convolutions of the projections ``xs`` over full sequences, fenced
        off from XLA's fusion choices around the core's kernels (values unchanged): their inputs
        and outputs pinned row-major (``layout.row_major``) and their outputs materialised (an
        optimisation barrier). Left free, XLA fuses the convolutions into the q / k L2 norms'
        reductions or into transposes feeding the core, computing them in a [B, D, T] layout.
        Train steps at the 340M shapes, H200: DeltaNet 110.5 -> 105.3 ms, GDN 131.5 -> 112.4
        (RESULTS runs 190-191); PDN 124.1 -> 116.7 (122.5 with the pins alone, 125.1 with the
        barrier alone, runs 184-188); OSDN 134.8 -> 125.8 with the barrier (H100, runs 181 /
        183). The barrier costs memory: +2.2 GiB a DeltaNet / GDN step (the outputs are kept).
        Not in ``step``: one token has nothing to lay out."""
        ys = tuple(row_major(m(row_major(x), cu_seqlens=cu_seqlens)) for m, x in zip(convs, xs))
        return jax.lax.optimization_barrier(ys)

    def _heads(self, q, k, v, normalize=True):
        """q, k L2-normalised per head (``normalize``; else as they are) and v, as [..., H, d]."""
        c = self.config
        split = lambda a, d: a.reshape(*a.shape[:-1], c.num_heads, d)
        norm = _l2norm if normalize else (lambda x: x)
        return norm(split(q, c.head_k_dim)), norm(split(k, c.head_k_dim)), split(v, c.head_v_dim)

    def _output(self, o, p):
        c = self.config
        gate = None
        if c.gated:
            gate = self.g_proj.layers[1](p["g_proj"]) if c.backbone == "kda" else p["g_proj"]
            gate = gate.reshape(*gate.shape[:-1], c.num_heads, c.head_v_dim)
        o = self.o_norm(o.astype(c.dtype), gate)
        return self.o_proj(o.reshape(*o.shape[:-2], c.value_dim))

    def _d_init(self, n):
        """OSGM d_1 [n, H, K]: ones, or exp(log_d_init) per head when it is learned."""
        c = self.config
        scale = jnp.exp(self.log_d_init[...]) if c.osgm_options.learn_init_scale else jnp.ones((c.num_heads,))
        return jnp.broadcast_to(scale.astype(jnp.float32)[None, :, None], (n, c.num_heads, c.head_k_dim))

    def _osgm_options(self, pre):
        """The OSGM op options (eta, d_min, d_max, retention, beta_aware, eps) of this layer, the
        retention r_t (APF) from the per-token inputs ``pre``."""
        o = self.config.osgm_options
        return dict(eta=o.eta, d_min=o.d_min, d_max=o.d_max, retention=pre.get("retention"),
                    beta_aware=o.beta_aware, eps=o.eps)

    def _write_key(self, k, beta, pre, state, sequence=None):
        """The write key and the preconditioner's new state: k̃ = k (none), d ⊙ k (OSGM, SPEC 3.1)
        or B(A) ⊙ k (ATK, SPEC 3.2).

        sequence None: one decode step, k [B, H, K] from the cached ``state`` (``osgm_step`` /
        ``atk_step``); otherwise the ops' full-sequence options (output_final_state, cu_seqlens,
        impl, chunk_size), k [B, T, H, K] from the initial ``state`` (None: the op's default).
        Returns (k̃, state or None)."""
        c = self.config
        if c.preconditioner == "atk":
            args = (k, pre["log_decay"], pre["gain"], self.log_atk_scale[...])
            options = dict(x=c.atk_options.squash_x, eps=c.atk_options.squash_eps)
            if sequence is None:
                return atk_step(*args, state, **options)
            return atk_precondition(*args, initial_state=state, **options, **sequence)
        if c.preconditioner.startswith("osgm"):
            options = self._osgm_options(pre)
            if sequence is None:
                return osgm_step(k, beta, state, **options)
            return osgm_precondition(k, beta, initial_state=state, **options, **sequence)
        return k, None

    # ---- full sequence ----

    def _forward(self, x, cu_seqlens, want_cache):
        c = self.config
        x = x.astype(c.dtype)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        p = self._project(x)
        pre_conv = (p["q_proj"], p["k_proj"], p["v_proj"])
        q, k, v = self._heads(*self._convolve(convs, pre_conv, cu_seqlens))
        beta, g, pre = self._gates(p)
        run = dict(output_final_state=want_cache, cu_seqlens=cu_seqlens, impl=c.impl,
                   chunk_size=c.chunk_size)
        p_state = None
        if c.preconditioner.startswith("osgm"):
            p_state = self._d_init(x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1)
        k_write, p_state = self._write_key(k, beta, pre, p_state, run)
        out, S = delta_rule(q, k, v, beta, write_key=k_write, log_decay=g, **run)
        y = self._output(out, p)
        if not want_cache:
            return y, None
        tails = tuple(m.tail(a, cu_seqlens=cu_seqlens) for m, a in zip(convs, pre_conv))
        if c.preconditioner.startswith("osgm"):
            p_state = _slots(p_state)
        return y, LayerCache(S, p_state, tails, jnp.zeros((S.shape[0],), jnp.int32))

    def __call__(self, x: Float[Array, "b t d"], *, cu_seqlens=None) -> Float[Array, "b t d"]:
        """Full-sequence output; ``cu_seqlens`` (B = 1): packed documents, every state restarts."""
        return self._forward(x, cu_seqlens, want_cache=False)[0]

    def prefill(self, x: Float[Array, "b t d"], *, cu_seqlens=None):
        """(output, ``LayerCache`` after the last token of every row / document)."""
        return self._forward(x, cu_seqlens, want_cache=True)

    # ---- decoding ----

    def init_cache(self, batch: int) -> LayerCache:
        """The state before any token: S = 0, d = d_1 (OSGM) or A = 0 (ATK), zero conv tails."""
        c = self.config
        H, K, W = c.num_heads, c.head_k_dim, c.conv_size
        p_state = None
        if c.preconditioner == "atk":
            p_state = jnp.zeros((batch, H, K), jnp.float32)
        elif c.preconditioner.startswith("osgm"):
            p_state = _slots(self._d_init(batch))
        tails = tuple(jnp.zeros((batch, W, d), c.dtype) for d in (c.key_dim, c.key_dim, c.value_dim))
        return LayerCache(jnp.zeros((batch, H, K, c.head_v_dim), jnp.float32), p_state, tails,
                          jnp.zeros((batch,), jnp.int32))

    def step(self, x: Float[Array, "b d"], cache: LayerCache):
        """One token per row in O(1): returns (output [B, D], the updated cache)."""
        c = self.config
        x = x.astype(c.dtype)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        p = self._project(x)
        pre_conv = (p["q_proj"], p["k_proj"], p["v_proj"])
        stepped = [m.step(a, tail, cache.position) for m, a, tail in zip(convs, pre_conv, cache.conv)]
        fused = self._fused_decode()
        # the fused kernel normalises q and k itself, but ATK's step needs k normalised before it
        in_kernel = fused and c.preconditioner != "atk"
        q, k, v = self._heads(*(s[0] for s in stepped), normalize=not in_kernel)
        beta, g, pre = self._gates(p)
        if fused:
            out, S, p_state = self._fused_core_step(q, k, v, beta, g, pre, cache, in_kernel)
        else:
            out, S, p_state = self._core_step(q, k, v, beta, g, pre, cache)
        return self._output(out, p), LayerCache(S, p_state, tuple(s[1] for s in stepped),
                                                 cache.position + 1)

    def _fused_decode(self) -> bool:
        """Whether ``step`` runs the fused kernel: ``config.fused_decode``, or when None whether the
        ops run on the Pallas path (impl "pallas", or "auto" on a GPU with head dims it takes)."""
        c = self.config
        if c.fused_decode is not None:
            return c.fused_decode
        return choose_impl("decode_step", c.impl, K=c.head_k_dim) == "pallas"

    def _core_step(self, q, k, v, beta, g, pre, cache):
        """(o, S, preconditioner state) of one token by the ops: the preconditioner's step
        (OSGM's d read from slot position mod 2, d_new written into the other), then
        ``delta_rule_step``."""
        state = cache.precond
        if not self.config.preconditioner.startswith("osgm"):
            k_write, new = self._write_key(k, beta, pre, state)
        else:
            current, d = _current_slot(state, cache.position)
            k_write, d_new = self._write_key(k, beta, pre, d)
            new = jnp.where(current, state, d_new[:, :, None])
        out, S = delta_rule_step(q, k, v, beta, cache.memory, write_key=k_write, log_decay=g)
        return out, S, new

    def _fused_core_step(self, q, k, v, beta, g, pre, cache, normalize):
        """(o, S, preconditioner state) of one token by ``decode_step``, one kernel: k̃ = k, or
        OSGM's d ⊙ k and d's update inside it (two slots, in place); ATK's k̃ and A from
        ``atk_step`` before it. ``normalize``: q and k come unnormalised, the kernel's L2 norm
        (``normalize_eps``) first."""
        osgm, k_write, p_state = None, None, cache.precond
        if self.config.preconditioner.startswith("osgm"):
            osgm = decode_step.OSGMStep(cache.precond, **self._osgm_options(pre), slot=cache.position % 2)
        elif self.config.preconditioner == "atk":
            k_write, p_state = self._write_key(k, beta, pre, cache.precond)
        out, S, d = decode_step.decode_step(q, k, v, beta, cache.memory, log_decay=g, write_key=k_write,
                                            osgm=osgm, normalize_eps=L2_EPS if normalize else None)
        return out, S, p_state if osgm is None else d
