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

from benchmarks.bench_decode_step import decode_loop
from benchmarks.bench_generate import model_for


def computations(text):
    """{name: its text} of an HLO module's text."""
    found = {}
    for block in re.split(r"\n(?=\S)", text):
        m = re.match(r"(?:ENTRY )?%?([\w.\-]+) ", block)
        if m:
            found[m.group(1)] = block
    return found


def loop_body(text):
    """The text of the body of the entry computation's while loop (exactly one expected)."""
    comps = computations(text)
    entry = next(block for block in comps.values() if block.startswith("ENTRY"))
    bodies = re.findall(r"\swhile\(.*?body=%?([\w.\-]+)", entry)
    if len(bodies) != 1:
        raise ValueError(f"expected one while loop in the entry computation, found {bodies}")
    return comps[bodies[0]]


def counts(body):
    """(fusions, custom calls, copy instructions of arrays) of a computation's text (copies of
    scalars, the loop's counters, left out)."""
    lines = body.splitlines()
    copies = [line.strip() for line in lines
              if re.search(r"=.*\scopy(-start)?\(", line) and not re.search(r"= \w+\[\] ", line)]
    fusions = sum(bool(re.search(r"=.*\sfusion\(", line)) for line in lines)
    customs = sum("custom-call(" in line for line in lines)
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
        for line in copies[:a.show]:
            print("   ", line[:160])


if __name__ == "__main__":
    main()
