"""The text the quality protocol trains language models on: the standard library's ``.py`` files
(:mod:`kdbench.data.corpus`) split by file, capped, cut into byte windows, and those windows in a student's own BPE
tokens.  Torch tensors on the host; the training and the checks are :mod:`kdbench.quality.text`'s.

The split.  The corpus's files are shuffled with a generator seeded by the split seed and the first
``round(test_fraction x files)`` are held out, whole: no held-out file is ever seen in training.  Each split's files
are joined in that order and cut at its share of ``max_bytes`` (``test_fraction`` of it held out).

The windows.  The tokens are the bytes (vocabulary 256), in windows of ``seq_len + 1`` bytes at a stride of
``seq_len``: the model reads the first ``seq_len`` and predicts each next one, so every byte of a split but its
first is predicted once.  Given the Python version and the seed, the data is the same; :class:`Corpus` names it,
with a hash of its bytes.

A student with its own tokenizer.  Its ``bpe:<N>`` is trained on the training split's text only
(:func:`train_split_tokenizer`), and it reads the same windows in its tokens (:func:`bpe_windows`): each window's
first byte one token and the rest BPE-encoded, so it predicts exactly the bytes the byte models predict
(:func:`in_own_tokens`).  Which tokens each model of a cell reads: :func:`tokenizer_of`, :func:`vocab_of` (the
teacher the bytes; a student the bytes, or its own ``data.tokenizers.student``).
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kdbench.config.quality import QualityConfig
from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.names import IGNORE_INDEX
from kdbench.data.corpus import join_files, stdlib_files, stdlib_root
from kdbench.data.tokenizers import BPETokenizer, train_bpe

__all__ = [
    "BYTES",
    "Corpus",
    "TextData",
    "bpe_windows",
    "in_own_tokens",
    "load_text",
    "own_tokenizer",
    "split_files",
    "split_text",
    "tokenizer_of",
    "train_split_tokenizer",
    "vocab_of",
    "windows",
]

BYTES = 256  # the vocabulary: one token per byte value


def split_files(files: list[str], test_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, held-out) files: shuffled by a generator seeded with ``seed``, the first share held out."""
    if len(files) < 2:
        raise KdbenchError(f"quality: the corpus has {len(files)} file(s); the split by file needs at least 2")
    order = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    n_test = min(len(files) - 1, max(1, round(test_fraction * len(files))))
    return order[n_test:], order[:n_test]


def windows(blob: bytes, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte labels, int64 (N, seq_len): windows of seq_len + 1 bytes at a stride of seq_len."""
    n = (len(blob) - 1) // seq_len
    if n < 1:
        raise KdbenchError(
            f"quality: {len(blob)} bytes make no window of seq_len + 1 = {seq_len + 1}; raise max_bytes or "
            "lower seq_len"
        )
    data = torch.frombuffer(bytearray(blob[: n * seq_len + 1]), dtype=torch.uint8).long()
    return data[:-1].view(n, seq_len).clone(), data[1:].view(n, seq_len).clone()


@dataclass(frozen=True)
class Corpus:
    """What the data set was read from, for the rows."""

    python: str
    files: int  # in the corpus
    train_files: int  # read (the cap may stop before the split's last)
    test_files: int
    train_bytes: int
    test_bytes: int
    sha256: str  # of the train bytes, then the held-out bytes

    def describe(self) -> str:
        return (
            f"python-stdlib {self.python}: {self.train_files} train + {self.test_files} held-out of {self.files} "
            f".py files, {self.train_bytes} + {self.test_bytes} bytes, sha256 {self.sha256[:12]}"
        )


@dataclass
class TextData:
    x_train: torch.Tensor  # int64 (N, S) byte ids
    y_train: torch.Tensor  # int64 (N, S): the next bytes
    x_test: torch.Tensor
    y_test: torch.Tensor
    corpus: Corpus
    num_classes: int = BYTES


def load_text(cfg: QualityConfig, seed: int = 0, root: Path | None = None) -> TextData:
    """The corpus split by file (``seed``; ``run_quality`` uses 0, one split for every seed), capped, in windows."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise KdbenchError(f"quality: the standard library folder {root} is not there; python-stdlib reads it")
    files = stdlib_files(root)
    train, test = split_files(files, cfg.test_fraction, seed)
    test_cap = None if cfg.max_bytes is None else round(cfg.max_bytes * cfg.test_fraction)
    train_cap = None if cfg.max_bytes is None else cfg.max_bytes - test_cap  # type: ignore[operator]
    train_blob, n_train = join_files(root, train, train_cap)
    test_blob, n_test = join_files(root, test, test_cap)
    seq_len = cfg.text_seq_len
    x_tr, y_tr = windows(train_blob, seq_len)
    x_te, y_te = windows(test_blob, seq_len)
    sha = hashlib.sha256(train_blob + test_blob).hexdigest()
    corpus = Corpus(platform.python_version(), len(files), n_train, n_test, len(train_blob), len(test_blob), sha)
    return TextData(x_tr, y_tr, x_te, y_te, corpus)


def split_text(x: torch.Tensor, y: torch.Tensor) -> bytes:
    """The bytes a split's windows cover (windows of seq_len + 1 at a stride of seq_len: each one's first byte,
    then every byte predicted): the split's text, cut where its last window ends."""
    if not len(x):
        return b""
    return bytes(x.flatten().tolist()) + bytes([int(y[-1, -1])])


def train_split_tokenizer(x_train: torch.Tensor, y_train: torch.Tensor, spec: str) -> BPETokenizer:
    """The student's ``bpe:<N>`` tokenizer, trained on the training split's text only (the bytes its windows cover):
    deterministic given that text and N, so the same for every seed (one split serves them all) and again on a
    resume."""
    return train_bpe([split_text(x_train, y_train)], int(spec.split(":", 1)[1]), name=spec.replace(":", "-"))


def bpe_windows(x: torch.Tensor, y: torch.Tensor, tokenizer: BPETokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte windows (inputs ``x`` and next bytes ``y``, (N, S)) in the student's own tokens: inputs and
    next-token labels (N, L), int64, padded at the end (input 0, label -100).

    Window i covers the bytes w = x[i, 0], y[i, :] (S + 1 of them).  Its first byte is one token (its byte's own
    BPE entry: every byte is one), read and not predicted, as the byte models read it; the S bytes after it are
    BPE-encoded on their own.  So the student predicts exactly the S bytes a byte model predicts of the window, in
    fewer tokens, and the held-out loss of every model is over the same bytes."""
    first = [tokenizer.encode(bytes([b]))[0] for b in range(256)]
    rest = tokenizer.encode_batch([bytes(row.tolist()) for row in y])
    seqs = [[first[int(b)], *ids] for b, ids in zip(x[:, 0].tolist(), rest)]
    width = max(len(ids) for ids in seqs) - 1
    inputs = torch.zeros(len(seqs), width, dtype=torch.int64)
    labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.int64)
    for i, ids in enumerate(seqs):
        n = len(ids) - 1
        inputs[i, :n] = torch.tensor(ids[:-1])
        labels[i, :n] = torch.tensor(ids[1:])
    return inputs, labels


def in_own_tokens(text: TextData, spec: str) -> tuple[BPETokenizer, TextData, float]:
    """A student's view of ``text``: its ``bpe:<N>`` tokenizer ``spec`` trained on the training split's text only
    (:func:`train_split_tokenizer`), both splits' windows in its tokens (:func:`bpe_windows`; ``num_classes`` its
    vocabulary), and its held-out tokens per predicted byte (the padding's labels not counted)."""
    tokenizer = train_split_tokenizer(text.x_train, text.y_train, spec)
    x_tr, y_tr = bpe_windows(text.x_train, text.y_train, tokenizer)
    x_te, y_te = bpe_windows(text.x_test, text.y_test, tokenizer)
    ratio = int((y_te != IGNORE_INDEX).sum()) / text.y_test.numel()
    return tokenizer, TextData(x_tr, y_tr, x_te, y_te, text.corpus, tokenizer.vocab_size), ratio


# --------------------------------------------------------------------------- which tokens each model reads


def own_tokenizer(c: CellConfig) -> str | None:
    """The spec of the student's own tokenizer (``data.tokenizers.student``, e.g. ``bpe:512``) where the cell gives
    it one other than the bytes; None for a byte-level student."""
    t = c.data.tokenizers
    return None if t is None or t.student == "bytes" else t.student


def tokenizer_of(c: CellConfig, role: str) -> str:
    """The name of the ``role`` model's tokenizer in the quality protocol: ``bytes`` or the student's own spec."""
    spec = own_tokenizer(c) if role != "teacher" else None
    return spec or "bytes"


def vocab_of(c: CellConfig, role: str) -> int:
    """The vocabulary the protocol builds the ``role`` model with: 256, or N for a student's ``bpe:N``."""
    spec = own_tokenizer(c) if role != "teacher" else None
    return BYTES if spec is None else int(spec.split(":", 1)[1])
