"""GPU kernels (Pallas) for the ops of ``precond_linattn``.

``REGISTRY`` maps an op name to ``(supports, kernel)``: ``supports(**call) -> bool`` says whether
the kernel takes a call's shapes and dtypes, ``kernel`` has the op's positional arguments.
"""

from pallas_kernels import atk_precond, delta_rule, osgm_precond

REGISTRY: dict = {"delta_rule": (delta_rule.supports, delta_rule.delta_rule_pallas),
                  "osgm_precondition": (osgm_precond.supports, osgm_precond.osgm_pallas),
                  "atk_precondition": (atk_precond.supports, atk_precond.atk_pallas)}
