"""Document sources: random-access sequences of document strings (grain ``RandomAccessDataSource``).

- ``TextFiles``: local files, indexed once by byte offsets so that reading document i opens its
  file and reads only its bytes. Formats:
    "text", unit "file":       one document per file (the whole file);
    "text", unit "paragraph":  documents separated by blank lines (lines of only whitespace),
                               stripped of surrounding whitespace; empty ones skipped;
    "jsonl":                   one JSON object per non-blank line; the document is the string
                               under ``text_field``.
  Files are taken in sorted path order after glob expansion; documents in file order.
- ``TinyCorpus``: generated English-like sentences, no files: document i is drawn from a generator
  seeded by (seed, i). Each document is 1–8 sentences; some state a fact ("the code of mira is
  4172.") and later ask for it again, so a model can learn in-context recall from it.
"""

import dataclasses
import glob
import json
import re

import numpy as np

FORMATS = ("text", "jsonl")
UNITS = ("file", "paragraph")
_PARAGRAPH_BREAK = re.compile(rb"\n[ \t\r\f\v]*\n")


def expand_paths(patterns) -> tuple[str, ...]:
    """Sorted, de-duplicated files matching the paths / glob patterns; an error if none match."""
    files = sorted({f for p in patterns for f in glob.glob(p, recursive=True)})
    if not files:
        raise ValueError(f"no files match {list(patterns)}")
    return tuple(files)


def _spans(data: bytes, fmt: str, unit: str):
    """(start, end) byte spans of the documents in one file's bytes."""
    if fmt == "jsonl":
        start = 0
        for line in data.splitlines(keepends=True):
            if line.strip():
                yield start, start + len(line)
            start += len(line)
    elif unit == "file":
        yield 0, len(data)
    else:
        start = 0
        for brk in [*_PARAGRAPH_BREAK.finditer(data), None]:
            end = len(data) if brk is None else brk.start()
            if data[start:end].strip():
                yield start, end
            start = end if brk is None else brk.end()


class TextFiles:
    """Documents of local text / JSONL files (see module docstring)."""

    def __init__(self, patterns, fmt: str = "text", *, unit: str = "file", text_field: str = "text"):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r}; expected one of {UNITS}")
        self.files, self.fmt, self.unit, self.text_field = expand_paths(patterns), fmt, unit, text_field
        index = []
        for f, path in enumerate(self.files):
            with open(path, "rb") as fh:
                index += [(f, s, e) for s, e in _spans(fh.read(), fmt, unit)]
        if not index:
            raise ValueError(f"no documents in {list(self.files)}")
        self.index = np.asarray(index, np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i) -> str:
        f, start, end = self.index[i]
        with open(self.files[f], "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        if self.fmt == "jsonl":
            record = json.loads(data)
            if not isinstance(record.get(self.text_field), str):
                raise ValueError(f"{self.files[f]} at byte {start}: no string field {self.text_field!r}")
            return record[self.text_field]
        text = data.decode("utf-8", errors="replace")
        return text.strip() if self.unit == "paragraph" else text


_NAMES = ("mira", "tobin", "sela", "arun", "kofi", "lena", "yuki", "omar", "ines", "pavel")
_ADJECTIVES = ("small", "quick", "quiet", "red", "old", "bright", "lazy", "brave")
_NOUNS = ("fox", "dog", "river", "lamp", "garden", "robot", "teacher", "boat", "cloud", "key")
_VERBS = ("sees", "follows", "paints", "finds", "carries", "watches", "builds", "hides")


@dataclasses.dataclass(frozen=True)
class TinyCorpus:
    """``num_documents`` generated documents (see module docstring)."""

    num_documents: int = 10_000
    seed: int = 0

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, i) -> str:
        rng = np.random.default_rng([self.seed, int(i)])
        pick = lambda words: words[rng.integers(len(words))]
        facts, sentences = {}, []
        for _ in range(rng.integers(1, 9)):
            kind = rng.integers(3)
            if kind == 0:
                name = pick(_NAMES)
                facts[name] = facts.get(name, int(rng.integers(1000, 10000)))
                sentences.append(f"the code of {name} is {facts[name]}.")
            elif kind == 1 and facts:
                name = pick(sorted(facts))
                sentences.append(f"what is the code of {name}? it is {facts[name]}.")
            else:
                sentences.append(f"the {pick(_ADJECTIVES)} {pick(_NOUNS)} {pick(_VERBS)} "
                                 f"the {pick(_ADJECTIVES)} {pick(_NOUNS)}.")
        return " ".join(sentences)
