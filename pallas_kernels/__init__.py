"""GPU kernels (Pallas) for the ops of ``precond_linattn``.

``REGISTRY`` maps an op name to ``(supports, kernel)``: ``supports(**call) -> bool`` says whether
the kernel takes a call's shapes and dtypes, ``kernel`` has the op's positional arguments
(``decode_step``: a layer's fused decode step, which has no plain-JAX op of its own).
"""

from pallas_kernels import atk_precond, decode_step, delta_rule, osgm_precond

REGISTRY: dict = {"delta_rule": (delta_rule.supports, delta_rule.delta_rule_pallas),
                  "osgm_precondition": (osgm_precond.supports, osgm_precond.osgm_pallas),
                  "atk_precondition": (atk_precond.supports, atk_precond.atk_pallas),
                  "decode_step": (decode_step.supports, decode_step.decode_step)}
