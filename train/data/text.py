"""Language-modelling tasks: documents -> tokens -> greedily packed rows (``train.data.packing``).

Common parameters (``PackedText``):
    seq_len           T, tokens per row
    max_docs_per_row  at most this many documents share a row; ``cu_seqlens`` has width
                      max_docs_per_row + 2 (the documents, a padding run, the end offset)
    max_doc_len       longer documents are cut into independent pieces of at most this many
                      tokens (the OSDN paper trains on documents of up to 4096); None means T

``TextTask`` reads local files (``train.data.sources.TextFiles``) with the byte tokenizer or a
local BPE file (``train.data.vocab``); ``TinyTextTask`` is the generated corpus
(``train.data.sources.TinyCorpus``) with the byte tokenizer, for runs that need no files.
"""

import abc
import dataclasses
import functools

import grain

from train.data.layout import AddCuSeqlens
from train.data.packing import Tokenize, pack_documents
from train.data.sources import TextFiles, TinyCorpus
from train.data.vocab import BPETokenizer, ByteTokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedText(abc.ABC):
    """Packing parameters shared by the text tasks (module docstring)."""

    seq_len: int = 2048
    max_docs_per_row: int = 64
    max_doc_len: int | None = None

    @property
    @abc.abstractmethod
    def tokenizer(self):
        """The task's tokenizer (``train.data.vocab``)."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def rows(self, docs: grain.MapDataset, batch_size: int,
             read_options: grain.ReadOptions) -> grain.IterDataset:
        """Document strings -> batches of the layout in ``train.data.layout``."""
        tokenizer = self.tokenizer
        max_doc_len = self.seq_len if self.max_doc_len is None else self.max_doc_len
        packed = pack_documents(docs.map(Tokenize(tokenizer)).to_iter_dataset(read_options),
                                seq_len=self.seq_len, max_docs_per_row=self.max_docs_per_row,
                                max_doc_len=max_doc_len, pad_id=tokenizer.pad_id)
        return packed.batch(batch_size, drop_remainder=True).map(AddCuSeqlens(self.max_docs_per_row + 1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextTask(PackedText):
    """Documents from local files.

    paths: files or glob patterns; format: "text" or "jsonl"; unit ("text" only): "file" or
    "paragraph"; text_field: the JSONL key of the document (see ``train.data.sources``).
    tokenizer_name: "byte" or "bpe"; vocab_file: the local tokenizer.json for "bpe";
    pad_token / bos_token / eos_token: the BPE vocabulary's special tokens.
    """

    paths: tuple[str, ...]
    format: str = "text"
    unit: str = "file"
    text_field: str = "text"
    tokenizer_name: str = "byte"
    vocab_file: str | None = None
    pad_token: str = "<pad>"
    bos_token: str = "<s>"
    eos_token: str = "</s>"

    def __post_init__(self):
        object.__setattr__(self, "paths", (self.paths,) if isinstance(self.paths, str) else tuple(self.paths))
        if self.tokenizer_name not in ("byte", "bpe"):
            raise ValueError(f"tokenizer_name must be 'byte' or 'bpe', got {self.tokenizer_name!r}")
        if (self.tokenizer_name == "bpe") != (self.vocab_file is not None):
            raise ValueError("vocab_file (a local tokenizer.json) is needed by, and only by, "
                             f"tokenizer_name='bpe'; got {self.tokenizer_name!r}, {self.vocab_file!r}")

    @functools.cached_property
    def tokenizer(self):
        if self.tokenizer_name == "byte":
            return ByteTokenizer()
        return BPETokenizer(self.vocab_file, self.pad_token, self.bos_token, self.eos_token)

    def source(self, seed: int) -> grain.MapDataset:
        """The documents of the files (``seed`` unused: the files fix them)."""
        return grain.MapDataset.source(TextFiles(self.paths, self.format, unit=self.unit,
                                                 text_field=self.text_field))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyTextTask(PackedText):
    """``num_documents`` generated documents (``TinyCorpus``), byte tokenizer."""

    seq_len: int = 256
    num_documents: int = 10_000

    @property
    def tokenizer(self):
        return ByteTokenizer()

    def source(self, seed: int) -> grain.MapDataset:
        """The generated documents; ``seed`` selects the corpus."""
        return grain.MapDataset.source(TinyCorpus(self.num_documents, seed))
