"""Preconditioned delta-rule linear attention in JAX (OSDN, PDN / PGDN / PKDA and backbones)."""

from precond_linattn.ops.atk import atk_precondition, atk_step
from precond_linattn.ops.delta import delta_rule, delta_rule_step
from precond_linattn.ops.osgm import osgm_precondition, osgm_step

__all__ = ["atk_precondition", "atk_step", "delta_rule", "delta_rule_step", "osgm_precondition",
           "osgm_step"]
