"""One layer's recurrent decode step (one token) as a single Pallas Triton-lowered kernel.

It fuses ``osgm_step`` (or a given write key) and ``delta_rule_step``, which XLA runs as ~6-7
small kernels a layer at batch 1 (launch-bound decoding), into one launch, and optionally the
L2 norms of q and k before them (four more small kernels a layer otherwise). Per (row, head),
with the float32 state S [K, V]:

    q, k ← x / sqrt(Σ x² + ε_n), rounded to their dtype      (optional: ``normalize_eps`` = ε_n)

    OSGM (optional, SPEC 3.1; ``osgm_step_fn``'s order of operations):
        s = k ⊙ k    n̄ = max(Σ s, ε)    g = β (beta-aware) or 1    w = η g / n̄
        a = ⟨d, s⟩   k̃ = d ⊙ k (rounded to k's dtype, as ``osgm_step`` returns it)
        d_new = clip(r d + w (1 − g a) s, d_min, d_max)             (r: APF retention, 1 without)
    else k̃ = the given write key (e.g. ATK's, from ``atk_step``) or k (no preconditioner)

    delta rule (SPEC 2, ``delta_step``):
        S̄ = S | exp(g) S | Diag(exp(g)) S          (no / scalar / per-channel decay)
        u = v − S̄ᵀ k      S_new = S̄ + β k̃ uᵀ      o = S_newᵀ (scale · q)

Grid (B, H, V / BV): each program holds one state tile S [K, BV] and the K-sized vectors; the
OSGM update is K-sized, so every V tile redoes it, and tile 0 alone stores d_new. The products
S̄ᵀ k and S_newᵀ q are column sums of broadcast products (no dots: one column of outputs a
tile). The new state may overwrite the old one (``input_output_aliases``). d_new cannot
overwrite d (another tile's program may read d after tile 0 wrote it), so a decoding loop would
copy the fresh d_new into its carry every step; given two slots d [B, H, 2, K] and each row's
``slot``, the programs read d from slot ``slot`` and tile 0 writes d_new into the other one,
the whole two-slot buffer aliased (updated in place, no copy; the caller alternates the slot).
Head dims that are
not powers of two >= 16 are zero-padded (``pow2_dim``) and the results sliced back. Inside a
``jit`` over a device mesh the call goes through ``partition.sharded_call`` (rows and heads stay
sharded). Without a GPU it runs in interpret mode.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.partition import sharded_call
from pallas_kernels.triton_common import (
    MAX_HEAD_DIM, TraceDefaults, interpret_default, out_struct, pad_last, pow2_dim)
from precond_linattn.ops.osgm import check_osgm_hyper
from precond_linattn.reference.osgm import osgm_step_fn
from precond_linattn.validation import check_array, check_scale, check_shape, check_tensor


class OSGMStep(NamedTuple):
    """The OSGM preconditioner's part of a decode step: its state d [B, H, K] (float32), the APF
    retention r [B, H] (None: r ≡ 1) and the hyper-parameters of ``osgm_step`` (Python numbers:
    they are compiled into the kernel). With ``slot`` [B] (int32), d is two slots [B, H, 2, K]:
    row b's d is d[b, :, slot_b] and d_new goes into d[b, :, 1 − slot_b] in place (the module
    docstring)."""

    d: jax.Array
    eta: float
    d_min: float
    d_max: float
    retention: jax.Array | None = None
    beta_aware: bool = True
    eps: float = 1e-6
    slot: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Launch:
    """The kernel's launch: block_v, the V tile BV of a program (a power of two >= 16; min(block_v,
    padded V)), and num_warps, warps a program (GPU only). RESULTS run 60: 32 / 4 the fastest of
    four launches without OSGM; run 194: one V tile of 128 with 8 warps (so that d_new could
    overwrite d) is ~30 µs a token slower at 24 layers than 32 / 4."""

    block_v: int = 32
    num_warps: int = 4

    def __post_init__(self):
        if not isinstance(self.block_v, int) or self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v!r}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps!r}")


_LAUNCH = TraceDefaults("default_launch", Launch, Launch())


def default_launch(launch: Launch | None):
    """Calls traced inside take ``launch`` where they name none, as the layers' ``step`` does (a
    benchmark's sweep); None keeps the current one."""
    return _LAUNCH.use(launch)


def supports(*, K: int) -> bool:
    """Whether the kernel suits key head dim K: padded to a power of two, K <= MAX_HEAD_DIM (one
    program holds K-sized vectors and a K x BV tile in registers; any V is tiled)."""
    return pow2_dim(K) <= MAX_HEAD_DIM


def _static(name: str, value) -> float:
    """``value`` as a Python float; ValueError naming ``name`` if it is traced (the kernel compiles
    it in as a constant)."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be a Python number (it is compiled into decode_step's kernel), "
                         "got a traced value")
    return float(value)


def _osgm_update(k, d, beta, r, hyper, kw_dtype):
    """(k̃ = d ⊙ k rounded to ``kw_dtype``, as ``osgm_step`` returns it, and d_new) of one token:
    ``osgm_step_fn`` on float32 K-vectors."""
    eta, d_min, d_max, beta_aware, eps = hyper
    kw, d_new = osgm_step_fn(d, k, beta, r, eta, d_min, d_max, beta_aware, eps)
    return kw.astype(kw_dtype).astype(jnp.float32), d_new


def _delta_update(S, q, k, kw, v, beta, alpha, scale):
    """(S_new = S̄ + β k̃ uᵀ with u = v − S̄ᵀ k and S̄ = alpha ⊙ S, o = S_newᵀ (scale q)) of one
    tile S [K, BV]; alpha None (no decay), a scalar or a [K, 1] column."""
    if alpha is not None:
        S = S * alpha
    u = v - jnp.sum(S * k[:, None], axis=0)
    S = S + (beta * kw)[:, None] * u[None, :]
    return S, jnp.sum(S * (scale * q)[:, None], axis=0)


def _unit(x, eps, dtype):
    """x / sqrt(Σ x² + eps) in float32, rounded to ``dtype`` (the layers' L2 norm), as float32."""
    return (x * jax.lax.rsqrt(jnp.sum(x * x) + eps)).astype(dtype).astype(jnp.float32)


def _kernel(*refs, names, decay, hyper, scale, normalize_eps):
    """One (row, head, V tile) program: the module docstring's step on its S tile; stores S_new,
    o and (V tile 0 only) d_new. ``names``: the input refs in order (outputs follow)."""
    inputs = dict(zip(names, refs))
    S_out, o_out, *d_out = refs[len(names):]
    f32 = lambda name: inputs[name][...].astype(jnp.float32)  # noqa: E731
    q, k, v, beta = f32("q"), f32("k"), f32("v"), f32("beta")
    if normalize_eps is not None:
        q, k = (_unit(x, normalize_eps, inputs["k"].dtype) for x in (q, k))
    if hyper is not None:
        r = f32("retention") if "retention" in inputs else None
        slot = inputs["slot"][0] if "slot" in inputs else None
        d = f32("d") if slot is None else inputs["d"][slot, :].astype(jnp.float32)
        kw, d_new = _osgm_update(k, d, beta, r, hyper, inputs["k"].dtype)

        @pl.when(pl.program_id(2) == 0)
        def _():
            if slot is None:
                d_out[0][...] = d_new
            else:
                d_out[0][1 - slot, :] = d_new
    else:
        kw = f32("write_key") if "write_key" in inputs else k
    alpha = None
    if decay is not None:
        alpha = jnp.exp(f32("log_decay"))
        alpha = alpha[:, None] if decay == "vector" else alpha
    S, o = _delta_update(inputs["state"][...], q, k, kw, v, beta, alpha, scale)
    S_out[...] = S
    o_out[...] = o.astype(o_out.dtype)


def _check(q, k, v, beta, state, log_decay, write_key, osgm):
    """ValueError naming the argument unless the shapes and dtypes are those of
    ``delta_rule_step`` (and of ``osgm_step`` for ``osgm``); returns the decay kind (None,
    "scalar" or "vector")."""
    check_array("q", q, 3, "[B, H, K]")
    B, H, K = q.shape
    check_tensor("k", k, (B, H, K), "[B, H, K]")
    check_array("v", v, 3, "[B, H, V]")
    check_tensor("v", v, (B, H, v.shape[-1]), "[B, H, V]")
    check_tensor("beta", beta, (B, H), "[B, H]")
    check_tensor("state", state, (B, H, K, v.shape[-1]), "[B, H, K, V]")
    if state.dtype != jnp.float32:
        raise ValueError(f"state must be float32, got {state.dtype}")
    if write_key is not None:
        if osgm is not None:
            raise ValueError("give write_key or osgm, not both: OSGM computes the write key")
        check_tensor("write_key", write_key, (B, H, K), "[B, H, K]")
    if osgm is not None:
        if not isinstance(osgm, OSGMStep):
            raise ValueError(f"osgm must be an OSGMStep or None, got {type(osgm).__name__}")
        if osgm.slot is None:
            check_tensor("osgm.d", osgm.d, (B, H, K), "[B, H, K]")
        else:
            check_tensor("osgm.d", osgm.d, (B, H, 2, K), "[B, H, 2, K] (two slots, with osgm.slot)")
            if osgm.d.dtype != jnp.float32:  # updated in place by the float32 d_new
                raise ValueError(f"osgm.d must be float32 with osgm.slot, got {osgm.d.dtype}")
            if not hasattr(osgm.slot, "dtype") or not jnp.issubdtype(osgm.slot.dtype, jnp.integer):
                raise ValueError("osgm.slot must be an integer array (0 or 1 a row), got "
                                 f"{getattr(osgm.slot, 'dtype', type(osgm.slot).__name__)}")
            check_shape("osgm.slot", osgm.slot, (B,), "[B]")
        if osgm.retention is not None:
            check_tensor("osgm.retention", osgm.retention, (B, H), "[B, H]")
        check_osgm_hyper(osgm.eta, osgm.d_min, osgm.d_max, osgm.beta_aware, osgm.eps, prefix="osgm.")
    if log_decay is None:
        return None
    if not hasattr(log_decay, "shape") or tuple(log_decay.shape) not in ((B, H), (B, H, K)):
        raise ValueError(f"log_decay must be None, [B, H] or [B, H, K] = {(B, H)} or {(B, H, K)}, "
                         f"got {getattr(log_decay, 'shape', log_decay)}")
    check_array("log_decay", log_decay, log_decay.ndim, "[B, H] or [B, H, K]")
    return "scalar" if log_decay.ndim == 2 else "vector"


KINDS = dict(row="b", scalar="b h", key="b h k", slots="b h s k", value="b h v",
             state="b h k v")  # operand kinds, by factors


def _spec(kind, K, BV):
    """The BlockSpec of an operand of ``kind`` for the grid (b, h, j): a scalar per (row, head),
    a K-vector, two slots of K-vectors, a V tile [BV] or the state tile [K, BV]; ``row``: a
    row's one-element block."""
    return dict(
        row=pl.BlockSpec((1,), lambda b, h, j: (b,)),
        scalar=pl.BlockSpec((None, None), lambda b, h, j: (b, h)),
        key=pl.BlockSpec((None, None, K), lambda b, h, j: (b, h, 0)),
        slots=pl.BlockSpec((None, None, 2, K), lambda b, h, j: (b, h, 0, 0)),
        value=pl.BlockSpec((None, None, BV), lambda b, h, j: (b, h, j)),
        state=pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j)))[kind]


def decode_step(q, k, v, beta, state, *, log_decay=None, write_key=None, osgm=None, scale=None,
                normalize_eps=None, launch: Launch | None = None, interpret=None):
    """One decoding token of a layer's delta rule, with its preconditioner, in one kernel:
    ``osgm_step`` then ``delta_rule_step`` (the module docstring's equations).

    Args:
      q, k: [B, H, K] (read key); v: [B, H, V]; beta: [B, H].
      state: S [B, H, K, V] float32 (the new state may reuse its buffer).
      log_decay: None, [B, H] (scalar, GDN) or [B, H, K] (per channel, KDA); g <= 0.
      write_key: k̃ [B, H, K] computed elsewhere (ATK's ``atk_step``); None: k̃ = k, or OSGM's.
      osgm: ``OSGMStep`` (d, retention, hyper-parameters, slot): k̃ = d ⊙ k and d's update; None:
        none.
      scale: query scale (a Python number), default K ** -0.5.
      normalize_eps: a Python number: q and k are L2-normalised in the kernel first (x / sqrt(Σ x²
        + normalize_eps), rounded to their dtype); None: they come normalised.
      launch: the kernel's ``Launch`` (V tile, warps); None: ``default_launch``'s.
      interpret: run in interpret mode; None: unless the default backend is a GPU.

    Returns:
      (o [B, H, V] in v's dtype, S_new [B, H, K, V] float32, d_new [B, H, K] float32 or None; with
      ``osgm.slot`` the two slots [B, H, 2, K], d_new in the other slot, in d's buffer).
    """
    decay = _check(q, k, v, beta, state, log_decay, write_key, osgm)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    check_scale("scale", scale)
    hyper = None if osgm is None else (
        *(_static(f"osgm.{n}", getattr(osgm, n)) for n in ("eta", "d_min", "d_max")), osgm.beta_aware,
        _static("osgm.eps", osgm.eps))
    launch = _LAUNCH.current if launch is None else launch
    if not isinstance(launch, Launch):
        raise ValueError(f"launch must be a decode_step.Launch or None, got {launch!r}")
    d, retention, slot = (None, None, None) if osgm is None else (osgm.d, osgm.retention, osgm.slot)
    if normalize_eps is not None:
        normalize_eps = _static("normalize_eps", normalize_eps)
        check_scale("normalize_eps", normalize_eps, minimum=0.0)
    return _step(q, k, v, beta, state, log_decay, write_key, d, retention, slot, decay=decay,
                 hyper=hyper, scale=_static("scale", scale), normalize_eps=normalize_eps, launch=launch,
                 interpret=interpret_default() if interpret is None else interpret)


@functools.partial(jax.jit, static_argnames=("decay", "hyper", "scale", "normalize_eps", "launch",
                                             "interpret"))
def _step(q, k, v, beta, state, log_decay, write_key, d, retention, slot, *, decay, hyper, scale,
          normalize_eps, launch, interpret):
    """``decode_step`` on checked arguments (``d``, ``retention``, ``slot``: ``OSGMStep``'s arrays,
    None without OSGM; ``hyper``: its numbers). A ``jit``, so that a decoding loop over many layers
    lowers the kernel once for all of them (as ``partition.lowered_once`` does for the ops)."""
    K, V = q.shape[-1], v.shape[-1]
    Kp, Vp = pow2_dim(K), pow2_dim(V)
    padded = Kp != K or Vp != V
    if padded:
        state = jnp.pad(state, [(0, 0), (0, 0), (0, Kp - K), (0, Vp - V)])
    inputs = dict(q=(pad_last(q, Kp), "key"), k=(pad_last(k, Kp), "key"), v=(pad_last(v, Vp), "value"),
                  beta=(beta, "scalar"), state=(state, "state"))
    if decay is not None:
        inputs["log_decay"] = (pad_last(log_decay, Kp), "key" if decay == "vector" else "scalar")
    if write_key is not None:
        inputs["write_key"] = (pad_last(write_key, Kp), "key")
    if d is not None:
        inputs["d"] = (pad_last(d, Kp), "key" if slot is None else "slots")
        if retention is not None:
            inputs["retention"] = (retention, "scalar")
        if slot is not None:
            inputs["slot"] = (slot.astype(jnp.int32), "row")
    kernel = functools.partial(_kernel, names=tuple(inputs), decay=decay, hyper=hyper, scale=scale,
                               normalize_eps=normalize_eps)
    o, S, d = _call(kernel, inputs, min(launch.block_v, Vp), launch.num_warps, interpret)
    if padded:
        o, S, d = o[..., :V], S[:, :, :K, :V], None if d is None else d[..., :K]
    return o, S, d


def _call(kernel, inputs, BV, num_warps, interpret):
    """(o, S_new, d_new or None) of ``kernel`` over the grid (B, H, Vp / BV) of ``inputs``
    {name: (array, kind)}, through ``sharded_call`` (rows and heads stay sharded on a mesh);
    S_new overwrites ``inputs["state"]`` and, in two slots, d_new ``inputs["d"]``, where XLA can."""
    names, arrays = list(inputs), [a for a, _ in inputs.values()]
    _, _, K, Vp = inputs["state"][0].shape
    outputs = [("state", jnp.float32), ("value", inputs["v"][0].dtype)]
    outputs += [(inputs["d"][1], jnp.float32)] if "d" in inputs else []
    aliases = {names.index("state"): 0} | ({names.index("d"): 2} if "slot" in inputs else {})

    def call(*xs):
        """The pallas_call on (a shard of) the operands."""
        size = dict(zip("bhkvs", (*xs[0].shape[:2], K, Vp, 2)))
        out_shape = [out_struct(tuple(size[f] for f in KINDS[kind].split()), dtype, *xs)
                     for kind, dtype in outputs]
        return tuple(pl.pallas_call(
            kernel, grid=(size["b"], size["h"], Vp // BV),
            in_specs=[_spec(kind, K, BV) for _, kind in inputs.values()],
            out_specs=[_spec(kind, K, BV) for kind, _ in outputs], out_shape=out_shape,
            input_output_aliases=aliases,
            compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret, name="decode_step")(*xs))

    S, o, *d = sharded_call(call, arrays, [KINDS[kind] for _, kind in inputs.values()],
                            [KINDS[kind] for kind, _ in outputs])
    return o, S, (d[0] if d else None)
