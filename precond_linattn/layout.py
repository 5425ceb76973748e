"""Memory layouts pinned for XLA's GPU layout assignment (values unchanged)."""

from jax.experimental.layout import Layout, with_layout_constraint


def row_major(x):
    """x with its layout pinned row-major (dims major to minor in order: [B, T, H] stays [B, T,
    H] in memory). Left free, XLA picks the layout a consumer wants and spreads it back through
    the producers: the kernels' [B, H, n, Tp] rows make every [B, T, H] reduction feeding them
    run as [B, H, T], strided (``pallas_kernels.rows_mosaic``; RESULTS run 180), and around the
    ATK kernels the short convolutions fuse into the L2 norms' reductions as one slow
    multi-output fusion (``layers.attention``; RESULTS runs 184-188)."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))
