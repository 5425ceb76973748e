"""GPU kernels (Pallas) for the ops of ``precond_linattn``.

``REGISTRY`` maps an op name to ``(supports, kernel)``: ``supports(**call) -> bool`` says whether
the kernel takes a call's shapes and dtypes, ``kernel`` has the op's positional arguments.
"""

REGISTRY: dict = {}
