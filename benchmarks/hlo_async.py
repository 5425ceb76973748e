"""What a compiled program runs while each of its asynchronous calls is in flight.

    python benchmarks/hlo_async.py STEP.hlo.txt [--show 12]

An XLA GPU stream annotation (``rows_mosaic.on_stream``: ``compute_on("gpu_stream:N")``)
becomes an asynchronous pair, ``call-start`` (or ``async-start``) and its ``call-done``, in the
optimised HLO (``bench_train.py --hlo``). The HLO of a scheduled module lists each computation's
instructions in their execution order, so only the instructions between a start and its done
can run beside the call: none means the other stream's work was serialised (RESULTS run 210:
every phase-1 call of OSDN's training step, with or without the latency-hiding scheduler).
Prints, per pair, the count of instructions between and the most common of them.
"""

import argparse
import collections
import re
import sys

from benchmarks import hlo_fusion

STARTS = ("call-start", "async-start")
DONES = ("call-done", "async-done")
QUIET = ("get-tuple-element", "bitcast", "tuple", "parameter", "constant")


def in_flight(text):
    """[(computation, start name, the computation it runs, [the instructions between the start
    and its done, as ``hlo_fusion.parse``'s tuples], the start's frontend attributes as
    written)] for every asynchronous pair."""
    comps, _ = hlo_fusion.parse(text)
    pairs = []
    for comp, insts in comps.items():
        opened = {}
        for i, inst in enumerate(insts):
            if inst[2] in STARTS:
                opened[inst[0]] = i
            elif inst[2] in DONES:
                start = re.match(r"\s*%([\w.\-]+)", inst[3]).group(1)
                if start in opened:
                    s = opened.pop(start)
                    runs = re.search(r"(?:to_apply|calls)=%([\w.\-]+)", insts[s][4])
                    attrs = re.search(r"frontend_attributes=\{([^}]*)\}", insts[s][4])
                    pairs.append((comp, start, runs.group(1) if runs else None, insts[s + 1:i],
                                  attrs.group(1) if attrs else ""))
    return pairs


def summary(between):
    """The instructions between a pair as {"opcode[:called computation]": count}, leaving out
    those that launch nothing (tuples, bitcasts, ...) and the starts and dones of pairs nested
    inside it (run 210: an outer ``called_computation`` pair holds the stream call's own)."""
    kinds = collections.Counter(
        inst[2] + (f":{hlo_fusion.called(inst)}" if hlo_fusion.called(inst) else "")
        for inst in between if inst[2] not in QUIET + STARTS + DONES)
    return dict(kinds.most_common())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", help="optimised HLO text (bench_train.py --hlo)")
    ap.add_argument("--show", type=int, default=12, help="pairs printed")
    a = ap.parse_args(argv)
    with open(a.hlo) as f:
        pairs = in_flight(f.read())
    alone = sum(not summary(p[3]) for p in pairs)
    print(f"{len(pairs)} asynchronous pairs, {alone} with nothing launched while in flight")
    for comp, start, runs, between, attrs in pairs[:a.show]:
        print(f"{comp}: {start} ({runs}) [{attrs}]: {len(between)} between {summary(between)}")


if __name__ == "__main__":
    sys.exit(main())
