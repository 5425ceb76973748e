"""What a kernel of a profile computes, read from the optimised HLO (``bench_train.py --hlo``).

    python benchmarks/hlo_fusion.py STEP.hlo.txt NAME [NAME ...] [--frames N]

NAME is a kernel as the profile names it (``input_concatenate_transpose_fusion_23``) or as the
HLO does (``input_concatenate_transpose_fusion.23``); a name without its number takes every
instruction of that kind. For each: the instruction (shape and layout: ``{1,0}`` is row-major
for rank 2; a permutation is a transposed layout), its operands with theirs, then the fused
computation's instructions, each with its jax op (the last two parts of its name) and the
innermost ``--frames`` Python frames that made it (file:line function, relative to the working
directory), from the HLO's stack-frame tables. So a layout-fallout fusion
points at the lines of the model that feed it.
"""

import argparse
import os
import re
import sys

_TABLE = re.compile(r"^(\d+) (.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")


def _closing(s, i):
    """The index just past the parenthesis that closes the one at ``s[i]``."""
    depth = 0
    while True:
        depth += {"(": 1, ")": -1}.get(s[i], 0)
        i += 1
        if depth == 0:
            return i


def _split_instruction(line):
    """(name, type, opcode, operands text, rest) of an HLO instruction line, or None."""
    m = re.match(r"^\s*(?:ROOT )?%(\S+) = ", line)
    if not m:
        return None
    i = m.end()
    j = _closing(line, i) if line[i] == "(" else line.index(" ", i)  # a tuple type, or one
    type_, i = line[i:j], j + 1
    j = line.index("(", i)
    k = _closing(line, j)
    return m.group(1), type_, line[i:j], line[j + 1:k - 1], line[k:]


def parse(text):
    """The module as (computations {name: [instruction tuples]}, a frame resolver)."""
    tables, section, comps, current = {}, None, {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
            continue
        m = _TABLE.match(line)
        if section is not None and m:
            section[int(m.group(1))] = m.group(2)
            continue
        section = None
        h = _HEADER.match(line)
        if h:
            current = comps.setdefault(h.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            parts = _split_instruction(line)
            if parts:
                current.append(parts)

    def field(entry, key):
        return int(re.search(rf"{key}=(\d+)", entry).group(1))

    def frames(frame_id, n):
        """The innermost n frames of ``frame_id`` as "file:line function" (the printed
        ``parent_frame_id`` is the parent's id + 1; 1 - 1 = 0 ends the chain)."""
        out, stack = [], tables.get("StackFrames", {})
        while frame_id and frame_id in stack and len(out) < n:
            entry = stack[frame_id]
            loc = tables["FileLocations"][field(entry, "file_location_id")]
            file = os.path.relpath(tables["FileNames"][field(loc, "file_name_id")].strip('"'))
            func = tables["FunctionNames"][field(loc, "function_name_id")].strip('"')
            out.append(f"{file}:{field(loc, 'line')} {func}")
            frame_id = field(entry, "parent_frame_id") - 1
        return out

    return comps, frames


def called(inst):
    """The name of the computation a fusion (or call) instruction runs, or None."""
    m = re.search(r"calls=%([\w.\-]+)", inst[4])
    return m.group(1) if m else None


def _metadata(rest):
    op = re.search(r'op_name="([^"]*)"', rest)
    frame = re.search(r"stack_frame_id=(\d+)", rest)
    return (op.group(1) if op else ""), (int(frame.group(1)) if frame else 0)


def describe(text, names, n_frames=3):
    """The report's lines for each name of ``names`` (see the module docstring)."""
    comps, frames = parse(text)
    defined = {inst[0]: inst for insts in comps.values() for inst in insts}
    lines = []
    for name in names:
        key = re.sub(r"_(\d+)$", r".\1", name)  # the profile's _23 is the HLO's .23
        numbered = re.search(r"\.\d+$", key)  # one instruction; else every one of the kind
        pattern = re.escape(key) + ("" if numbered else r"(\.\d+)?")
        found = [i for i in defined.values() if re.fullmatch(pattern, i[0])]
        if not found:
            lines.append(f"{name}: no such instruction")
            continue
        for inst in found:
            inst_name, type_, opcode, operands, _ = inst
            lines.append(f"{inst_name} = {type_} {opcode}")
            for op in re.findall(r"%([\w.\-]+)", operands):
                src = defined.get(op)
                lines.append(f"  operand {op}: {src[1] + ' ' + src[2] if src else '?'}")
            for sub in comps.get(called(inst), []):
                if sub[2] in ("parameter", "constant"):
                    continue
                op_name, frame = _metadata(sub[4])
                where = "; ".join(frames(frame, n_frames))
                op_name = "/".join(op_name.split("/")[-2:])  # e.g. jvp()/transpose
                lines.append(f"    {sub[2]:14s} {sub[1]:32s} {op_name}  [{where}]")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", help="optimised HLO text (bench_train.py --hlo)")
    ap.add_argument("names", nargs="+", help="kernel or instruction names")
    ap.add_argument("--frames", type=int, default=3, help="Python frames a line (innermost first)")
    a = ap.parse_args(argv)
    with open(a.hlo) as f:
        print("\n".join(describe(f.read(), a.names, a.frames)))


if __name__ == "__main__":
    sys.exit(main())
