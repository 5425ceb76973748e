"""What a decoding loop's compiled step holds: the fusions, custom calls (the fused decode
kernels) and copies in the body of ``bench_decode_step.decode_loop``'s ``fori_loop`` as XLA
compiles it for this machine's backend. A copy there is a cache buffer the step could not
update in place (RESULTS run 194: 72 with DeltaNet-340M before the cache became rings and
slots; run 200: one, the position).

    PYTHONPATH=. python benchmarks/decode_loop_hlo.py [--preset deltanet-340m]
        [--preconditioners none osgm] [--fused on] [--steps 8] [--tiny] [--show 12]
"""

import argparse
import re

from benchmarks import hlo_fusion
from benchmarks.bench_decode_step import decode_loop
from benchmarks.bench_generate import model_for


def loop_body(text):
    """The instructions (``hlo_fusion.parse``'s tuples) of the body of the entry computation's
    while loop (exactly one expected)."""
    comps, _ = hlo_fusion.parse(text)
    entry = re.search(r"^ENTRY %(\S+) ", text, re.M).group(1)
    bodies = [re.search(r"body=%([\w.\-]+)", inst[4]).group(1)
              for inst in comps[entry] if inst[2] == "while"]
    if len(bodies) != 1:
        raise ValueError(f"expected one while loop in the entry computation, found {bodies}")
    return comps[bodies[0]]


def counts(body):
    """(fusions, custom calls, copy instructions of arrays) of a computation's instructions
    (copies of scalars, the loop's counters, left out), the copies as (name, type)."""
    copies = [inst[:2] for inst in body
              if inst[2] in ("copy", "copy-start") and not inst[1].endswith("[]")]
    fusions = sum(inst[2] == "fusion" for inst in body)
    customs = sum(inst[2] == "custom-call" for inst in body)
    return fusions, customs, copies


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="deltanet-340m")
    ap.add_argument("--preconditioners", nargs="+", default=["none", "osgm"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fused", default="on", choices=("on", "off", "auto"),
                    help="the layers' fused decode kernel (bench_decode_step's --fused)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--show", type=int, default=12, help="copies printed a model")
    a = ap.parse_args()
    for pre in a.preconditioners:
        decode, args = decode_loop(model_for(a.preset, pre, a.fused, a.tiny), a.steps)
        fusions, customs, copies = counts(loop_body(decode.lower(*args).compile().as_text()))
        print(f"{a.preset}/{pre}: {fusions} fusions, {customs} custom calls, {len(copies)} copies")
        for name, type_ in copies[:a.show]:
            print(f"    {name} {type_}")


if __name__ == "__main__":
    main()
