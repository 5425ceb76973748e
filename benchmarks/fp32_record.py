"""One model's check problem and its fp32 answer in an ``.npz``, so that another process (FLA's,
in PyTorch: ``bench_fla.py --against``) measures its bf16 errors on the very inputs and
cotangents of ``bench_ops --sections fp32``. NumPy only.

A record holds the bf16 inputs (as float32 values), the cotangents of the output and of the final
state, the chunked form's fp32 output, final state and gradients of the model's inputs, and the
errors already measured (``errors``: {label: {name: relative RMS error}}). The error of a
candidate a against the fp32 value b is ‖a − b‖ / ‖b‖ (float64 sums).
"""

import json

import numpy as np


def rel_rms(a, b):
    """‖a − b‖ / ‖b‖ over all elements, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.sum((a - b) ** 2) / np.sum(b ** 2)))


def save(path, model, x, cotangents, ref, errors):
    """Write ``model``'s record: inputs ``x`` {name: array}, ``cotangents`` (of o, of the final
    state), ``ref`` (o, final, {name: gradient}) in fp32 and ``errors`` {label: {name: error}}."""
    ct_o, ct_final = cotangents
    o, final, grads = ref
    arrays = {f"x_{n}": np.asarray(a, np.float32) for n, a in x.items()}
    arrays |= {f"grad_{n}": np.asarray(g, np.float32) for n, g in grads.items()}
    np.savez(path, **arrays, ct_o=np.asarray(ct_o, np.float32),
             ct_final=np.asarray(ct_final, np.float32), ref_o=np.asarray(o, np.float32),
             ref_final=np.asarray(final, np.float32),
             meta=np.array(json.dumps(dict(model=model, errors=errors))))


def load(path):
    """A record as a dict: model, x, ct_o, ct_final, ref_o, ref_final, grads, errors."""
    with np.load(path) as f:
        meta = json.loads(str(f["meta"]))
        pick = lambda prefix: {n[len(prefix):]: f[n] for n in f.files  # noqa: E731
                               if n.startswith(prefix)}
        return dict(model=meta["model"], errors=meta["errors"], x=pick("x_"), grads=pick("grad_"),
                    **{n: f[n] for n in ("ct_o", "ct_final", "ref_o", "ref_final")})


def errors(o, final, grads, ref_o, ref_final, ref_grads):
    """{o, final, and each name of ``ref_grads``: relative RMS error}, rounded to 3 digits."""
    errs = {"o": rel_rms(o, ref_o), "final": rel_rms(final, ref_final),
            **{n: rel_rms(grads[n], g) for n, g in ref_grads.items()}}
    return {n: float(f"{e:.3g}") for n, e in errs.items()}
