"""``python -m precond_linattn``: check every model family on a built-in random problem.

For each backbone (DeltaNet / GDN / KDA) × preconditioner (none / OSGM / OSGM+APF / ATK) the
write key and the outputs are computed by the token-by-token reference and by the chunked form;
the table shows their relative difference and the residual ratio q_geo (SPEC section 5).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import precond_linattn as pla
from precond_linattn.diagnostics import ratio_summary, residual_ratio

BACKBONES = ("DeltaNet", "GDN", "KDA")
PRECONDITIONERS = ("none", "OSGM", "OSGM+APF", "ATK")
NAMES = {("DeltaNet", "none"): "DeltaNet", ("DeltaNet", "OSGM"): "OSDN",
         ("DeltaNet", "OSGM+APF"): "OSDN-APF", ("DeltaNet", "ATK"): "PDN",
         ("GDN", "none"): "GDN", ("GDN", "OSGM"): "OSGDN", ("GDN", "OSGM+APF"): "OSGDN-APF",
         ("GDN", "ATK"): "PGDN", ("KDA", "none"): "KDA", ("KDA", "OSGM"): "OSKDA",
         ("KDA", "OSGM+APF"): "OSKDA-APF", ("KDA", "ATK"): "PKDA"}


def problem(seed, B, T, H, K, V):
    """Random L2-normalised q, k, values, gates and decays, as the layers would make them."""
    r = np.random.default_rng(seed)

    def unit(*s):
        x = r.standard_normal(s) / np.arange(1, s[-1] + 1) ** 0.5  # skewed coordinate energy
        return jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True), jnp.float32)

    def unif(lo, hi, *s):
        return jnp.asarray(r.uniform(lo, hi, s), jnp.float32)

    return dict(q=unit(B, T, H, K), k=unit(B, T, H, K),
                v=jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32),
                beta=unif(0.2, 0.9, B, T, H), g_scalar=-unif(0.001, 0.1, B, T, H),
                g_vector=-unif(0.001, 0.1, B, T, H, K), retention=unif(0.99, 1.0, B, T, H),
                atk_decay=-unif(0.001, 0.05, B, T, H), atk_gain=unif(0.3, 1.0, B, T, H),
                center=jnp.full((H,), -0.2, jnp.float32))


def write_key(p, preconditioner, impl):
    if preconditioner == "none":
        return p["k"]
    if preconditioner == "ATK":
        return pla.atk_precondition(p["k"], p["atk_decay"], p["atk_gain"], p["center"], impl=impl)[0]
    retention = p["retention"] if preconditioner == "OSGM+APF" else None
    return pla.osgm_precondition(p["k"], p["beta"], eta=0.05, retention=retention, impl=impl)[0]


def run(p, backbone, preconditioner, impl):
    g = {"DeltaNet": None, "GDN": p["g_scalar"], "KDA": p["g_vector"]}[backbone]
    kw = write_key(p, preconditioner, impl)
    o, _ = pla.delta_rule(p["q"], p["k"], p["v"], p["beta"], write_key=kw, log_decay=g, impl=impl)
    return kw, o, g


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=300)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    p = problem(a.seed, a.batch, a.length, a.heads, a.head_dim, a.head_dim)
    print(f"backend {jax.default_backend()}; B={a.batch} T={a.length} H={a.heads} "
          f"K=V={a.head_dim}; chunked vs reference, fp32")
    print(f"{'model':10s} {'backbone':9s} {'precond':9s} {'err k_write':>12s} {'err o':>10s} "
          f"{'q_geo':>7s} {'secs':>6s}")
    worst = 0.0
    for backbone in BACKBONES:
        for pre in PRECONDITIONERS:
            t0 = time.perf_counter()
            kw_ref, o_ref, g = run(p, backbone, pre, "reference")
            kw, o, _ = run(p, backbone, pre, "chunked")
            err_k = float(jnp.abs(kw - kw_ref).max() / jnp.abs(kw_ref).max())
            err_o = float(jnp.abs(o - o_ref).max() / jnp.abs(o_ref).max())
            ratio, mask = residual_ratio(p["k"], p["v"], p["beta"], write_key=kw, log_decay=g)
            q_geo = float(ratio_summary(ratio, mask)[0])
            worst = max(worst, err_k, err_o)
            print(f"{NAMES[backbone, pre]:10s} {backbone:9s} {pre:9s} {err_k:12.2e} {err_o:10.2e} "
                  f"{q_geo:7.4f} {time.perf_counter() - t0:6.1f}")
    print(f"largest relative difference: {worst:.2e} ({'OK' if worst <= 1e-4 else 'TOO LARGE'})")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
