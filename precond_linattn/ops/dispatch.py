"""Choosing an implementation: "reference", "chunked", "pallas" or "auto".

"auto" takes the Pallas kernel when the default backend is a GPU and a kernel registered in
``pallas_kernels.REGISTRY`` supports the call, else the chunked pure-JAX form.
"""

import jax

from precond_linattn.validation import check_impl


def pallas_kernel(op: str):
    """``(supports, kernel)`` for ``op`` from pallas_kernels, or None."""
    import pallas_kernels

    return pallas_kernels.REGISTRY.get(op)


def choose_impl(op: str, impl: str, **call) -> str:
    """The implementation name to run ``op`` with for this call."""
    check_impl(impl)
    kernel = pallas_kernel(op)
    if impl == "auto":
        on_gpu = jax.default_backend() == "gpu"
        return "pallas" if on_gpu and kernel is not None and kernel[0](**call) else "chunked"
    if impl == "pallas" and kernel is None:
        raise ValueError(f"impl='pallas' is not available for {op}: no Pallas kernel is registered; "
                         "use impl='chunked' or 'reference'")
    return impl
