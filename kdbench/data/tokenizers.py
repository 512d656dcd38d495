"""Tokenizers for pairs whose models do not share one: bytes in, token ids out, and back, exactly.

Two kinds, one interface (:class:`Tokenizer`: ``name``, ``vocab_size``, ``encode(bytes) -> list[int]``,
``decode(ids) -> bytes``):

* :class:`ByteTokenizer`: one token per byte value (256 entries), the byte-level models' tokenizer.
* :class:`BPETokenizer`: a byte-level BPE tokenizer of the ``tokenizers`` library (Hugging Face's Rust
  tokenizers, installed with transformers), trained here on text the caller gives (:func:`train_bpe`; nothing
  is downloaded) or read from a ``tokenizer.json`` that this module wrote (:func:`load_bpe`).

Byte-exact.  The BPE works on a string in which each byte is one character (GPT-2's byte-to-unicode table:
the 256 byte values as 256 printable characters, none of them whitespace), so every byte string can be
encoded, whatever its encoding or wherever a window of it was cut, and ``decode(encode(b)) == b``.  So a
model's loss over a text can be put in **bits per byte** of that text, which compares models whose
tokenizers differ (perplexities per token do not).  The pre-tokenizer splits before each space and newline
byte (so a merge never crosses a word's start); the base alphabet is all 256 bytes, so no byte is unknown.

Training is deterministic: the same text and vocabulary size give the same merges (a test holds it).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from kdbench.core.errors import KdbenchError
from kdbench.core.install import extra_hint

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "Tokenizer",
    "byte_chars",
    "byte_spans",
    "load_bpe",
    "token_lengths",
    "train_bpe",
]

MAX_BPE_VOCAB = 1 << 20


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, data: bytes) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> bytes: ...


class ByteTokenizer:
    """One token per byte value: the id of a byte is its value."""

    name = "bytes"
    vocab_size = 256

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, ids: Sequence[int]) -> bytes:
        return bytes(int(i) for i in ids)


@functools.cache
def byte_chars() -> tuple[str, ...]:
    """GPT-2's byte-to-unicode table: the character of each byte value, 256 distinct printable characters
    (the printable Latin-1 bytes are themselves; the others are shifted to U+0100 and up)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


@functools.cache
def _char_bytes() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_chars())}


def _to_chars(data: bytes) -> str:
    table = byte_chars()
    return "".join(table[b] for b in data)


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - installed with transformers
        raise KdbenchError(f"a BPE tokenizer needs the tokenizers library: {extra_hint('lm')}") from e
    return tokenizers


class BPETokenizer:
    """A byte-level BPE :class:`Tokenizer` (see the module's docstring) around a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer, name: str):
        self._tok = tokenizer
        self.name = name
        self.vocab_size = int(tokenizer.get_vocab_size())
        self._bytes_of = [b"" for _ in range(self.vocab_size)]
        char_bytes = _char_bytes()
        for token, i in tokenizer.get_vocab().items():
            self._bytes_of[i] = bytes(char_bytes[c] for c in token)

    def encode(self, data: bytes) -> list[int]:
        return self._tok.encode(_to_chars(data)).ids

    def encode_batch(self, texts: Sequence[bytes]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch([_to_chars(t) for t in texts])]

    def decode(self, ids: Sequence[int]) -> bytes:
        return b"".join(self._bytes_of[int(i)] for i in ids)

    def token_bytes(self) -> list[int]:
        """How many bytes each token id stands for."""
        return [len(b) for b in self._bytes_of]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path))
        return path


def _blank(tokenizers):
    from tokenizers import Regex, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.BPE())
    space, newline = byte_chars()[ord(" ")], byte_chars()[ord("\n")]
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"[{space}{newline}]"), behavior="merged_with_next")
    return tok


def train_bpe(texts: Iterable[bytes], vocab_size: int, name: str | None = None) -> BPETokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` entries (256 bytes + merges) trained on ``texts``."""
    if not 256 < vocab_size <= MAX_BPE_VOCAB:
        raise KdbenchError(f"a BPE tokenizer's vocab_size must lie in (256, {MAX_BPE_VOCAB}], got {vocab_size}")
    tokenizers = _tokenizers()
    from tokenizers import trainers

    tok = _blank(tokenizers)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=list(byte_chars()), special_tokens=[], show_progress=False
    )
    chunks = [_to_chars(t) for t in texts]
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    return BPETokenizer(tok, name or f"bpe-{vocab_size}")


def load_bpe(path: str | Path) -> BPETokenizer:
    """A BPE tokenizer saved by :meth:`BPETokenizer.save` (a ``tokenizer.json`` of this module's byte alphabet);
    a file that is missing, unreadable, or of another alphabet is refused with the reason."""
    path = Path(path)
    if not path.is_file():
        raise KdbenchError(f"tokenizer file {path} does not exist: give a tokenizer.json that kdbench wrote")
    tokenizers = _tokenizers()
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own parse errors
        raise KdbenchError(f"tokenizer file {path} is not a tokenizers JSON file ({e})") from e
    vocab = tok.get_vocab()
    chars = set(_char_bytes())
    if any(c not in chars for token in vocab for c in token) or not chars <= set(vocab):
        raise KdbenchError(
            f"tokenizer file {path} is not byte-level over kdbench's byte alphabet (every byte a token, every token "
            "made of byte characters): train it with kdbench (kdbench.data.tokenizers.train_bpe)"
        )
    return BPETokenizer(tok, path.stem)


def token_lengths(tokenizer: Tokenizer) -> list[int]:
    """How many bytes each token id of ``tokenizer`` stands for (a byte tokenizer's: 1 each): what places a
    token sequence on the text it decodes to (:func:`byte_spans`)."""
    lengths = getattr(tokenizer, "token_bytes", None)
    return list(lengths()) if lengths is not None else [1] * tokenizer.vocab_size


def byte_spans(tokenizer: Tokenizer, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Each token's ``(start, end)`` byte offsets in ``decode(ids)`` (end exclusive): the text each token covers,
    which is what lines up two tokenizations of one text (ULD aligned by bytes, :mod:`kdbench.distill.lm.uld`).
    Exact because every tokenizer here is byte-exact (``decode`` is the tokens' bytes joined)."""
    lengths, spans, end = token_lengths(tokenizer), [], 0
    for i in ids:
        spans.append((end, end + lengths[int(i)]))
        end += lengths[int(i)]
    return spans


def digest(tokenizer: Tokenizer) -> str:
    """A short hash of what the tokenizer maps (its kind and, for BPE, its vocabulary), for rows."""
    if isinstance(tokenizer, BPETokenizer):
        text = json.dumps(sorted(tokenizer._tok.get_vocab().items()))
    else:
        text = tokenizer.name
    return hashlib.sha256(text.encode()).hexdigest()[:12]
