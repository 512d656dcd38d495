"""Cross-tokenizer LM cells (``data.tokenizers``): each model reads real text through its own tokenizer.

The text.  Windows of the standard library's ``.py`` source (:mod:`kdbench.data.corpus`, the text the quality
protocol reads): the sorted files joined, the first :data:`TRAIN_BYTES` the training share on which a
``bpe:<N>`` tokenizer is trained (deterministically, once per process, kept in memory), the next
:data:`TEXT_BYTES` the text the batches are cut from.  Sequence b of a batch starts at an offset drawn from the
cell's seed; its window is the text of the teacher's first ``data.seq_len`` tokens there (so the teacher's
sequence is ``seq_len`` tokens of its tokenizer, as on a one-tokenizer cell), and the student reads the same
bytes in its own tokens.

Fixed shapes.  The teacher's ids are (B, seq_len); the student's (B, L), L the most student tokens any window
of the batch takes (the batch's text is fixed, so L is the cell's), a shorter sequence padded at its end with
token 0 and label -100 (counted in no loss).  Labels are next-token targets on each side.

The prompt, by text position.  ``data.prompt_fraction`` of the teacher's ``seq_len`` tokens is the prompt (as
on any LM cell); its bytes are the prompt text, and each side masks the labels of its positions whose token
lies wholly within that text (the student's token that straddles the prompt's end is an answer token).  ULD
(:mod:`kdbench.distill.lm.uld`) then pairs the i-th answer position of one side with the i-th of the other,
by position after the prompt, as its paper does (``uld.alignment: position``); or, with ``uld.alignment: bytes``,
the answer positions of the two sides that have read the same text, by the byte offsets of each side's tokens
(:func:`kdbench.distill.lm.uld.byte_alignment`; the step row's ``uld_matched`` is the share of the student's
answer positions so paired).

The step.  Every step tokenizes the batch's text with both tokenizers and aligns the two sides (the step's
``align`` phase, :data:`kdbench.core.names.ALIGN`, timed), writing into the same tensors each step, so the loss
finds its rows once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kdbench.core.errors import KdbenchError
from kdbench.core.fakes import known_values, with_values
from kdbench.core.names import IGNORE_INDEX
from kdbench.core.schema import Row
from kdbench.data.corpus import join_files, stdlib_files, stdlib_root
from kdbench.data.tokenizers import ByteTokenizer, Tokenizer, digest, load_bpe, token_lengths, train_bpe
from kdbench.data.tokens import prompt_tokens
from kdbench.distill.lm.uld import Alignment, byte_alignment, matched_share, next_token_offsets, uld_alignment
from kdbench.hw.layout import place_aligned

__all__ = [
    "TEXT_BYTES",
    "TRAIN_BYTES",
    "TextBatch",
    "cross_tokenizer",
    "paired_step",
    "student_ids",
    "text_batch",
    "text_token_batch",
    "tokenizer_columns",
    "tokenizer_of",
    "tokenizer_size",
]

TRAIN_BYTES = 1 << 19  # the corpus's first 512 KiB: what bpe:<N> tokenizers are trained on
TEXT_BYTES = 1 << 20  # the next MiB: what batches are cut from
BPE_CHUNK = 1 << 16  # the training text handed to the trainer in pieces of this many bytes


def cross_tokenizer(config: Any) -> bool:
    """Whether the cell's two models tokenize differently (``data.tokenizers`` with two different specs)."""
    t = getattr(config.data, "tokenizers", None)
    return t is not None and t.teacher != t.student


@functools.cache
def corpus() -> bytes:
    """The joined corpus: the training share, then the batches' text."""
    blob, _ = join_files(stdlib_root(), stdlib_files(), TRAIN_BYTES + TEXT_BYTES)
    if len(blob) < TRAIN_BYTES + TEXT_BYTES:
        raise KdbenchError(
            f"cross-tokenizer cells read {TRAIN_BYTES + TEXT_BYTES} bytes of the standard library's .py files "
            f"({stdlib_root()}); found {len(blob)}"
        )
    return blob


@functools.cache
def tokenizer_of(spec: str) -> Tokenizer:
    """The tokenizer a ``data.tokenizers`` entry names: ``bytes``, ``bpe:<N>`` (trained on the corpus's training
    share, once per process) or a tokenizer.json kdbench wrote."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        train = corpus()[:TRAIN_BYTES]
        pieces = [train[i : i + BPE_CHUNK] for i in range(0, len(train), BPE_CHUNK)]
        return train_bpe(pieces, int(spec[4:]), name=spec)
    return load_bpe(spec)


def tokenizer_size(spec: str) -> int:
    """The vocabulary a tokenizer spec gives, for the plan (a bpe:<N> is not trained for it: N; a file is read)."""
    if spec == "bytes":
        return ByteTokenizer.vocab_size
    if spec.startswith("bpe:"):
        return int(spec[4:])
    return tokenizer_of(spec).vocab_size


def tokenizer_columns(config: Any) -> Row:
    """The step row's tokenizer columns: each side's tokenizer and a digest of what it maps (None without
    ``data.tokenizers``); and a uld cell's alignment, with the share of the student's answer positions it pairs
    (on the cell's batch; 1 where both models read the same tokens: every position pairs)."""
    t = getattr(config.data, "tokenizers", None)
    uld = {"uld_alignment": None, "uld_matched": None}
    if getattr(config, "method", None) == "uld":
        uld["uld_alignment"] = config.uld.alignment
        if cross_tokenizer(config):
            s_labels, align = _aligned(config, config.batch_size, config.seed)
            uld["uld_matched"] = matched_share(align, s_labels)
        else:
            uld["uld_matched"] = 1.0
    if t is None:
        return {"teacher_tokenizer": None, "student_tokenizer": None, **uld}
    return {**{f"{role}_tokenizer": _described(getattr(t, role)) for role in ("teacher", "student")}, **uld}


def _described(spec: str) -> str:
    tok = tokenizer_of(spec)
    return spec if spec == "bytes" else f"{spec} ({tok.vocab_size} tokens, sha256 {digest(tok)})"


@functools.cache
def _token_bytes(spec: str) -> tuple[int, ...]:
    return tuple(token_lengths(tokenizer_of(spec)))


@dataclass(frozen=True)
class TextBatch:
    """A cross-tokenizer batch's text: each sequence's window (bytes), the bytes of its prompt, and the student's
    padded length."""

    windows: tuple[bytes, ...]
    prompt_bytes: tuple[int, ...]
    student_len: int


@functools.lru_cache(maxsize=16)
def text_batch(teacher: str, student: str, batch_size: int, seq_len: int, prompt_fraction: float, seed: int):
    """The :class:`TextBatch` of a cell (specs, shape, seed): each window the text of the teacher's first
    ``seq_len`` tokens at an offset drawn from ``seed`` in the corpus's batch text."""
    t_tok, s_tok = tokenizer_of(teacher), tokenizer_of(student)
    text = corpus()[TRAIN_BYTES:]
    rng = np.random.default_rng(seed)
    prompt = prompt_tokens(seq_len, prompt_fraction)  # as a one-tokenizer cell's token batch masks it
    windows, prompts = [], []
    for _ in range(batch_size):
        span = 8 * seq_len
        if span >= len(text):
            raise KdbenchError(f"data.seq_len {seq_len} is too long for the {len(text)} bytes of cross-tokenizer text")
        start = int(rng.integers(0, len(text) - span))
        ids = t_tok.encode(text[start : start + span])
        while len(ids) < seq_len and start + span < len(text):
            span *= 2
            ids = t_tok.encode(text[start : start + span])
        if len(ids) < seq_len:
            raise KdbenchError(f"data.seq_len {seq_len}: the cross-tokenizer text ends before {seq_len} tokens")
        windows.append(t_tok.decode(ids[:seq_len]))
        prompts.append(len(t_tok.decode(ids[:prompt])))
    student_len = max(len(s_tok.encode(w)) for w in windows)
    return TextBatch(tuple(windows), tuple(prompts), max(student_len, 2))


def encode_side(spec: str, batch: TextBatch, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One side's ids and next-token labels (B, length), long, on the host: each window in its tokens (cut at
    ``length``, padded with 0 and label -100), the labels of its positions within the prompt text -100."""
    tok, sizes = tokenizer_of(spec), _token_bytes(spec)
    ids = torch.zeros((len(batch.windows), length), dtype=torch.long)
    labels = torch.full((len(batch.windows), length), IGNORE_INDEX, dtype=torch.long)
    for b, (window, prompt) in enumerate(zip(batch.windows, batch.prompt_bytes)):
        row = tok.encode(window)[:length]
        n, end, within = len(row), 0, 0
        for token in row:  # the tokens wholly within the prompt text
            end += sizes[token]
            if end > prompt:
                break
            within += 1
        ids[b, :n] = torch.tensor(row, dtype=torch.long)
        labels[b, : n - 1] = ids[b, 1:n]
        labels[b, :within] = IGNORE_INDEX
    return ids, labels


def paired(config: Any, batch_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Both sides' ids and labels of the cell's text batch and their alignment (by the cell's ``uld.alignment``), on
    the host: (student ids, student labels, teacher ids, teacher labels, the Alignment's student rows, teacher rows,
    weights, sequences)."""
    t = config.data.tokenizers
    batch = text_batch(t.teacher, t.student, batch_size, config.data.seq_len, config.data.prompt_fraction, seed)
    t_ids, t_labels = encode_side(t.teacher, batch, config.data.seq_len)
    s_ids, s_labels = encode_side(t.student, batch, batch.student_len)
    if config.uld.alignment == "bytes":  # the positions that have read the same text
        s_offsets = next_token_offsets(s_ids, torch.tensor(_token_bytes(t.student)))
        t_offsets = next_token_offsets(t_ids, torch.tensor(_token_bytes(t.teacher)))
        align = byte_alignment(s_labels, t_labels, s_offsets, t_offsets)
    else:  # the authors' form: the i-th answer position of each side
        align = uld_alignment(s_labels, t_labels)
    return s_ids, s_labels, t_ids, t_labels, align.student, align.teacher, align.weight, align.sequence


def _aligned(config: Any, batch_size: int, seed: int) -> tuple[torch.Tensor, Alignment]:
    """The student's labels of the cell's text batch and ULD's alignment of it (as :func:`paired` makes them)."""
    made = paired(config, batch_size, seed)
    return made[1], Alignment(*made[4:])


def student_ids(config: Any, batch_size: int, device: torch.device, seed: int) -> torch.Tensor:
    """The student's own ids (B, L) of the cell's text batch at ``seed``: what its serving rows read (the
    teacher's are the cell's batch)."""
    t = config.data.tokenizers
    batch = text_batch(t.teacher, t.student, batch_size, config.data.seq_len, config.data.prompt_fraction, seed)
    return encode_side(t.student, batch, batch.student_len)[0].to(device)


def text_token_batch(config: Any, batch_size: int, device: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``data.tokenizers`` cell's batch: the teacher's ids and labels of its text windows, placed at the cell's
    alignment; with one tokenizer, both models'."""
    t = config.data.tokenizers
    text = text_batch(t.teacher, t.student, batch_size, config.data.seq_len, config.data.prompt_fraction, seed)
    ids, labels = encode_side(t.teacher, text, config.data.seq_len)
    return place_aligned(ids.to(device), config.alignment), place_aligned(labels.to(device), config.alignment)


def paired_step(config: Any, fixed: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
    """The step's ``align`` phase of a cross-tokenizer cell: ``(x, y) -> (student ids, student labels, teacher ids,
    the loss's extra inputs)``, the batch's text tokenized by both tokenizers and aligned every call (``x``: the
    teacher's ids of :func:`paired`, whose batch size and device it takes), written into the same tensors each
    call.  In a fit's fake run (:mod:`kdbench.fit`) computed for real and handed on as fake tensors carrying their
    values.  It steps on ``fixed`` alone, the cell's batch the step was built for: any other batch is refused, not
    silently replaced by the cell's text."""
    staging: list[Staging] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple:
        if x is not fixed:
            raise KdbenchError(
                "a cross-tokenizer step tokenizes its cell's own text batch (kdbench.workloads.lm.xtok), not another "
                "batch: give each side's tokens to the loss yourself (LossInputs.teacher_targets, .alignment)"
            )
        fake = known_values(x) is not None
        with _real() if fake else contextlib.nullcontext():
            made = paired(config, x.shape[0], config.seed)
        if fake:
            out = [with_values(x.fake_mode.from_tensor(t), t) for t in made]
        else:
            if not staging:
                staging.append(Staging(x.device))
            out = staging[0](made)
        s_ids, s_labels, t_ids, t_labels, *parts = out
        return s_ids, s_labels, t_ids, {"teacher_targets": t_labels, "alignment": Alignment(*parts)}

    return step


class Staging:
    """A step's host-made tensors onto the device, into the same device tensors every call.  On a GPU without a
    sync (GPU review 4, M7: eight blocking pageable copies a step drained the device): each call's tensors go into
    one of two sets of pinned host buffers, used in turn, and from there to the device with ``non_blocking``; a set
    is written again only after the device has finished the copy made from it two calls before (its event: done
    unless the device is two steps behind).  On the CPU a plain copy.  ``pin`` and ``event`` make a pinned host
    tensor and a recorded device event (injectable for tests)."""

    def __init__(self, device: torch.device, asynchronous: bool | None = None, pin=None, event=None) -> None:
        self.device = device
        self.asynchronous = device.type != "cpu" if asynchronous is None else asynchronous
        self.pin = pin or (lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        self.event = event or _recorded_event
        self.host: list[list[torch.Tensor] | None] = [None, None]
        self.done: list[Any] = [None, None]
        self.turn = 0
        self.kept: list[torch.Tensor] = []

    def __call__(self, made: list[torch.Tensor]) -> list[torch.Tensor]:
        if not (self.kept and all(k.shape == m.shape for k, m in zip(self.kept, made))):
            self.kept = [torch.empty_like(m, device=self.device) for m in made]
            self.host = [None, None]
        if not self.asynchronous:
            return [k.copy_(m) for k, m in zip(self.kept, made)]
        i, self.turn = self.turn, 1 - self.turn
        if self.host[i] is None:
            self.host[i] = [self.pin(m) for m in made]
        elif self.done[i] is not None:
            self.done[i].synchronize()  # the copy out of this set, two calls ago
        out = []
        for k, h, m in zip(self.kept, self.host[i], made):
            h.copy_(m)
            out.append(k.copy_(h, non_blocking=True))
        self.done[i] = self.event()
        return out


def _recorded_event() -> Any:
    event = torch.cuda.Event()
    event.record()
    return event


def _real():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()
