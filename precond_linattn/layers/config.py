"""Configuration of the attention layer: backbone × preconditioner and their options.

Every model of both papers is one backbone (decay) × one preconditioner (write key), DESIGN.md:

    backbone        "deltanet" (no decay) | "gdn" (scalar decay per head) | "kda" (per-channel decay)
    preconditioner  "none" | "osgm" (OSDN, SPEC 3.1) | "osgm_apf" (OSDN + APF) | "atk" (PDN, SPEC 3.2)

Options that belong to one preconditioner live in their own dataclass (``OSGMConfig``,
``ATKConfig``); leaving it None gives the paper defaults, and setting it for a variant it does not
apply to is a ValueError, as is any other inconsistent choice; scalar options go through the ops'
own check (``precond_linattn.validation.check_scale``), named by their path (e.g. "osgm.eta").
The dataclasses are frozen and hashable, so a config can be a static argument of ``jax.jit``.
"""

import dataclasses
import math

import jax.numpy as jnp

from precond_linattn.validation import check_chunk_size, check_impl, check_scale

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
    """One attention layer. Dimensions: H heads of key size K = head_dim and value size
    V = head_dim · expand_v; head_dim None means hidden_size / num_heads (must divide).

    use_gate: the output gate of the head-wise RMSNorm (o = RMSNorm(o) ⊙ act(g_proj(x))); None
      means the backbone's FLA default (DeltaNet False, GDN True with SiLU, KDA always, with a
      low-rank projection and a sigmoid).
    allow_neg_eigval: β = 2σ(b_proj(x)) ∈ (0, 2) instead of σ(·) ∈ (0, 1).
    dtype / param_dtype: compute and parameter dtypes (states are always float32).
    impl / chunk_size: passed to the ops (``impl="auto"``: Pallas on GPU when available).
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

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
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
            set_("head_dim", self.hidden_size // self.num_heads)
        _require(isinstance(self.head_dim, int) and self.head_dim >= 1,
                 f"head_dim must be a positive int, got {self.head_dim!r}")
        v = self.head_dim * self.expand_v
        _require(v >= 1 and math.isclose(v, round(v)),
                 f"head_dim * expand_v must be a positive integer, got {self.head_dim} * {self.expand_v}")
        if self.use_gate is None:
            set_("use_gate", self.backbone != "deltanet")
        _require(self.use_gate or self.backbone != "kda",
                 "use_gate=False does not apply to backbone 'kda': its output gate is part of the layer")
        _require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        check_impl(self.impl)
        check_chunk_size(self.chunk_size)
        set_("dtype", jnp.dtype(self.dtype))
        set_("param_dtype", jnp.dtype(self.param_dtype))
        self._resolve_osgm()
        self._resolve_atk()

    def _resolve_osgm(self):
        if not self.preconditioner.startswith("osgm"):
            _require(self.osgm is None, "osgm options apply only to preconditioner 'osgm' or "
                     f"'osgm_apf', got preconditioner={self.preconditioner!r}")
            return
        o = self.osgm or OSGMConfig()
        apf = self.preconditioner == "osgm_apf"
        _require(apf or o.init_retention is None,
                 "osgm.init_retention applies only to preconditioner 'osgm_apf' (the APF gate)")
        if apf and o.init_retention is None:
            o = dataclasses.replace(o, init_retention=0.999)
        _require(not apf or 0.0 < o.init_retention < 1.0,
                 f"osgm.init_retention must be in (0, 1), got {o.init_retention}")
        check_scale("osgm.eta", o.eta, minimum=0.0)
        check_scale("osgm.d_min", o.d_min, minimum=0.0, strict=True)
        check_scale("osgm.d_max", o.d_max)
        _require(o.d_min <= o.d_max, f"osgm box needs 0 < d_min <= d_max, got [{o.d_min}, {o.d_max}]")
        check_scale("osgm.eps", o.eps, minimum=0.0, strict=True)
        object.__setattr__(self, "osgm", o)

    def _resolve_atk(self):
        if self.preconditioner != "atk":
            _require(self.atk is None, "atk options apply only to preconditioner 'atk', "
                     f"got preconditioner={self.preconditioner!r}")
            return
        a = self.atk or ATKConfig()
        check_scale("atk.squash_x", a.squash_x, minimum=1.0)
        check_scale("atk.squash_eps", a.squash_eps, minimum=0.0, strict=True)
        object.__setattr__(self, "atk", a)

    @property
    def head_v_dim(self) -> int:
        return round(self.head_dim * self.expand_v)

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_heads * self.head_v_dim

    @property
    def variant(self) -> str:
        """The paper's name of this backbone × preconditioner (e.g. "OSGDN-APF")."""
        return VARIANT_NAMES[self.backbone, self.preconditioner]
