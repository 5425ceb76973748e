"""Dimension legend and array aliases shared by the library.

Letters used in jaxtyping annotations and in shape-suffixed names (``k_BTHK``):

    B  batch (1 when sequences are packed with ``cu_seqlens``)
    T  time (tokens)
    H  heads
    K  key / query head dimension
    V  value head dimension
    N  number of documents (B without ``cu_seqlens``, len(cu_seqlens) - 1 with it)
    C  chunk length
    NC number of chunks
"""

from jaxtyping import Array, Bool, Float, Int

__all__ = ["Array", "Bool", "Float", "Int"]
