"""Tokenizers: text -> int32 ids, with PAD / BOS / EOS ids and a vocabulary size.

- ``ByteTokenizer`` (the default): ids 0..255 are the UTF-8 bytes of the text; PAD = 256,
  BOS = 257, EOS = 258; vocab_size = 259. Needs no file; ``decode(encode(s)) == s``.
- ``BPETokenizer``: a Hugging Face ``tokenizers`` JSON file (tokenizer.json) read from local disk
  with ``Tokenizer.from_file``, which never downloads. Its PAD / BOS / EOS ids are those of the
  named special tokens, which must be in its vocabulary; ``encode`` adds no special tokens itself.

A document becomes ``[BOS] + encode(text) + [EOS]`` (``encode_document``).
"""

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes; ids 256, 257, 258 are PAD, BOS, EOS."""

    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    vocab_size: int = 259

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """Text of the byte ids in ``ids``; special ids are dropped, invalid UTF-8 replaced."""
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class BPETokenizer:
    """A local ``tokenizers`` JSON file; specials named by their token strings."""

    path: str
    pad_token: str = "<pad>"
    bos_token: str = "<s>"
    eos_token: str = "</s>"

    @functools.cached_property
    def _tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.path)

    def _special(self, token: str) -> int:
        i = self._tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary of {self.path}")
        return i

    @property
    def pad_id(self) -> int:
        return self._special(self.pad_token)

    @property
    def bos_id(self) -> int:
        return self._special(self.bos_token)

    @property
    def eos_id(self) -> int:
        return self._special(self.eos_token)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=True)


def encode_document(tokenizer, text: str) -> np.ndarray:
    """``[BOS] + encode(text) + [EOS]`` as int32."""
    return np.concatenate([[tokenizer.bos_id], tokenizer.encode(text), [tokenizer.eos_id]]).astype(np.int32)

