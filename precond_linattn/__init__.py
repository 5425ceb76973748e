"""Preconditioned delta-rule linear attention in JAX (OSDN, PDN / PGDN / PKDA and backbones)."""

from precond_linattn.ops.delta import delta_rule, delta_rule_step

__all__ = ["delta_rule", "delta_rule_step"]
