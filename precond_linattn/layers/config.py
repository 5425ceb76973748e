"""Configuration of the attention layer: backbone × preconditioner and their options.

Every model of both papers is one backbone (decay) × one preconditioner (write key), DESIGN.md:

    backbone        "deltanet" (no decay) | "gdn" (scalar decay per head) | "kda" (per-channel decay)
    preconditioner  "none" | "osgm" (OSDN, SPEC 3.1) | "osgm_apf" (OSDN + APF) | "atk" (PDN, SPEC 3.2)

Options that belong to one preconditioner live in their own dataclass (``OSGMConfig``,
``ATKConfig``); leaving it None gives the paper defaults, and setting it for a variant it does not
apply to is a ValueError, as is any other inconsistent choice; their scalars go through the ops'
own checks (``check_osgm_hyper``, ``check_atk_squash``), named by their path (e.g. "osgm.eta").
A ``LayerConfig`` keeps every field as the user set it (None: derive it) and derives on read
(``head_k_dim``, ``gated``, ``osgm_options``, ``atk_options``), so ``dataclasses.replace`` never
leaves a stale derived value. The dataclasses are frozen and hashable, so a config can be a static
argument of ``jax.jit``.
"""

import dataclasses
import math

import jax.numpy as jnp

from precond_linattn.numerics import SUPPORTED_DTYPES
from precond_linattn.ops.atk import check_atk_squash
from precond_linattn.ops.osgm import check_osgm_hyper
from precond_linattn.validation import check_chunk_size, check_impl

BACKBONES = ("deltanet", "gdn", "kda")
PRECONDITIONERS = ("none", "osgm", "osgm_apf", "atk")
VARIANT_NAMES = {
    ("deltanet", "none"): "DeltaNet", ("deltanet", "osgm"): "OSDN",
    ("deltanet", "osgm_apf"): "OSDN-APF", ("deltanet", "atk"): "PDN",
    ("gdn", "none"): "GDN", ("gdn", "osgm"): "OSGDN", ("gdn", "osgm_apf"): "OSGDN-APF",
    ("gdn", "atk"): "PGDN", ("kda", "none"): "KDA", ("kda", "osgm"): "OSKDA",
    ("kda", "osgm_apf"): "OSKDA-APF", ("kda", "atk"): "PKDA"}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _as_dtype(name: str, value) -> jnp.dtype:
    """``value`` as a ``jnp.dtype``; ValueError naming ``name`` unless it is a supported one."""
    try:
        supported = value is not None and jnp.dtype(value) in SUPPORTED_DTYPES
    except TypeError:
        supported = False
    _require(supported, f"{name} must be one of {', '.join(map(str, SUPPORTED_DTYPES))}, got {value!r}")
    return jnp.dtype(value)


@dataclasses.dataclass(frozen=True)
class OSGMConfig:
    """OSDN preconditioner d_t (SPEC 3.1):

        k̃_t = d_t ⊙ k_t,   d_{t+1} = clip(r_t d_t − eta ∇h_t(d_t), d_min, d_max)

    beta_aware: the paper's main (340M) update; False is the beta-free update used at 1.3B.
    learn_init_scale: d_1 = exp(log_d_init_h) per head, a parameter initialised to 0 (d_1 = 1);
      False keeps d_1 = 1 fixed.
    init_retention: APF only ("osgm_apf"): the retention r_t = σ(w_hᵀx_t + b_h) starts near this
      value (b_h = logit(init_retention)); None gives 0.999, and it must stay None for "osgm".
    """

    eta: float = 0.003
    d_min: float = 0.5
    d_max: float = 2.0
    beta_aware: bool = True
    eps: float = 1e-6
    learn_init_scale: bool = False
    init_retention: float | None = None


@dataclasses.dataclass(frozen=True)
class ATKConfig:
    """PDN preconditioner (SPEC 3.2): k̃ = exp(−log(x)·softsign(log(A_t + eps) − c_h)) ⊙ k.

    squash_x: x >= 1 (k̃/k in [1/x, x]); center_init: initial per-head centre c_h
    (FLA's ``log_atk_scale``, used directly); squash_eps: eps inside the log.
    """

    squash_x: float = 1.5
    squash_eps: float = 1e-6
    center_init: float = -0.2


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """One attention layer. Dimensions: H heads of key size K = ``head_k_dim`` and value size
    V = K · expand_v (``head_v_dim``).

    Fields hold what the user set; the values derived from other fields stay unset (None) and are
    read through properties, so ``dataclasses.replace`` re-derives them:

    head_dim: K; None means hidden_size / num_heads (must divide). In use: ``head_k_dim``.
    use_gate: the output gate of the head-wise RMSNorm (o = RMSNorm(o) ⊙ act(g_proj(x))); None
      means the backbone's FLA default (DeltaNet False, GDN True with SiLU, KDA always, with a
      low-rank projection and a sigmoid). In use: ``gated``.
    osgm / atk: the preconditioner's options; None means the defaults. In use: ``osgm_options`` /
      ``atk_options`` (None for a preconditioner they do not apply to).
    allow_neg_eigval: β = 2σ(b_proj(x)) ∈ (0, 2) instead of σ(·) ∈ (0, 1).
    dtype / param_dtype: compute and parameter dtypes (states are always float32), stored as
      ``jnp.dtype`` (so equal configs hash equally; this reads no other field).
    impl / chunk_size: passed to the ops (``impl="auto"``: Pallas on GPU when available).
    fused_decode: ``step`` (one decode token) runs the preconditioner's update and the delta step
      in one Pallas kernel (``pallas_kernels.decode_step``; ATK's write key stays ``atk_step``);
      None means where the ops run on the Pallas path (impl "pallas", or "auto" on a GPU when the
      kernel takes the head dims), else the two ops ``osgm_step`` / ``delta_rule_step``. True /
      False force it on / off (True on a CPU runs the kernel in interpret mode).
    """

    hidden_size: int
    num_heads: int
    backbone: str = "deltanet"
    preconditioner: str = "none"
    head_dim: int | None = None
    expand_v: float = 1.0
    conv_size: int = 4
    conv_bias: bool = False
    use_gate: bool | None = None
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-5
    osgm: OSGMConfig | None = None
    atk: ATKConfig | None = None
    dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32
    impl: str = "auto"
    chunk_size: int = 64
    fused_decode: bool | None = None

    def __post_init__(self):
        _require(self.backbone in BACKBONES,
                 f"backbone must be one of {BACKBONES}, got {self.backbone!r}")
        _require(self.preconditioner in PRECONDITIONERS,
                 f"preconditioner must be one of {PRECONDITIONERS}, got {self.preconditioner!r}")
        for name in ("hidden_size", "num_heads", "conv_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            _require(self.hidden_size % self.num_heads == 0,
                     f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads} "
                     "(set head_dim to decouple the head size from the width)")
        _require(isinstance(self.head_k_dim, int) and self.head_k_dim >= 1,
                 f"head_dim must be a positive int, got {self.head_dim!r}")
        v = self.head_k_dim * self.expand_v
        _require(v >= 1 and math.isclose(v, round(v)),
                 f"head_dim * expand_v must be a positive integer, got {self.head_k_dim} * {self.expand_v}")
        _require(self.use_gate is None or isinstance(self.use_gate, bool),
                 f"use_gate must be None or a bool, got {self.use_gate!r}")
        _require(self.gated or self.backbone != "kda",
                 "use_gate=False does not apply to backbone 'kda': its output gate is part of the layer")
        _require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        check_impl(self.impl)
        _require(self.fused_decode is None or isinstance(self.fused_decode, bool),
                 f"fused_decode must be None or a bool, got {self.fused_decode!r}")
        check_chunk_size(self.chunk_size)
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, _as_dtype(name, getattr(self, name)))
        self._check_osgm()
        self._check_atk()

    def _check_osgm(self):
        if not self.preconditioner.startswith("osgm"):
            _require(self.osgm is None, "osgm options apply only to preconditioner 'osgm' or "
                     f"'osgm_apf', got preconditioner={self.preconditioner!r}")
            return
        _require(self.osgm is None or isinstance(self.osgm, OSGMConfig),
                 f"osgm must be an OSGMConfig or None, got {type(self.osgm).__name__}")
        o = self.osgm_options
        if self.preconditioner == "osgm":
            _require(o.init_retention is None,
                     "osgm.init_retention applies only to preconditioner 'osgm_apf' (the APF gate)")
        else:
            _require(0.0 < o.init_retention < 1.0,
                     f"osgm.init_retention must be in (0, 1), got {o.init_retention}")
        check_osgm_hyper(o.eta, o.d_min, o.d_max, o.beta_aware, o.eps, prefix="osgm.")

    def _check_atk(self):
        if self.preconditioner != "atk":
            _require(self.atk is None, "atk options apply only to preconditioner 'atk', "
                     f"got preconditioner={self.preconditioner!r}")
            return
        _require(self.atk is None or isinstance(self.atk, ATKConfig),
                 f"atk must be an ATKConfig or None, got {type(self.atk).__name__}")
        check_atk_squash(self.atk_options.squash_x, self.atk_options.squash_eps, prefix="atk.squash_")

    @property
    def head_k_dim(self) -> int:
        """K: ``head_dim``, or when None hidden_size // num_heads."""
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def head_v_dim(self) -> int:
        """V = K · expand_v."""
        return round(self.head_k_dim * self.expand_v)

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_heads * self.head_v_dim

    @property
    def gated(self) -> bool:
        """Whether the output gate is on: ``use_gate``, or when None backbone != "deltanet"."""
        return self.backbone != "deltanet" if self.use_gate is None else self.use_gate

    @property
    def osgm_options(self) -> OSGMConfig | None:
        """The OSGM options in use: ``osgm`` or the defaults, with init_retention 0.999 for
        "osgm_apf" when unset; None unless the preconditioner is "osgm" / "osgm_apf"."""
        if not self.preconditioner.startswith("osgm"):
            return None
        o = OSGMConfig() if self.osgm is None else self.osgm
        if self.preconditioner == "osgm_apf" and o.init_retention is None:
            return dataclasses.replace(o, init_retention=0.999)
        return o

    @property
    def atk_options(self) -> ATKConfig | None:
        """The ATK options in use: ``atk`` or the defaults; None unless the preconditioner is "atk"."""
        if self.preconditioner != "atk":
            return None
        return ATKConfig() if self.atk is None else self.atk

    @property
    def variant(self) -> str:
        """The paper's name of this backbone × preconditioner (e.g. "OSGDN-APF")."""
        return VARIANT_NAMES[self.backbone, self.preconditioner]
