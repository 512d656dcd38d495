"""A student with its own tokenizer in the text protocol (:mod:`kdbench.quality.text`): which cells may have one
(:func:`check_tokenizers`), its model's vocabulary (:func:`model_overrides`), and ULD's rows between it and the byte
teacher, paired by position (the authors' form: the loss pairs the i-th counted position of each side itself)
or by bytes (:func:`kdbench.distill.lm.uld.byte_alignment`: the positions that have read the same bytes of the
window).  Both sides read the same window from its first byte (the student's first token is that byte), so each
position's bytes read are its inputs' byte lengths summed."""

from __future__ import annotations

from typing import Any

import torch

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.data.text import BYTES, vocab_of
from kdbench.distill.lm.uld import Alignment, byte_alignment, matched_share, next_token_offsets, uld_alignment
from kdbench.models.hub import is_callable_name

__all__ = ["check_tokenizers", "model_overrides", "paired_share", "window_alignment"]


def model_overrides(c: CellConfig, role: str) -> dict[str, Any]:
    """The ``role`` model's overrides with its vocabulary forced over the cell's: 256 bytes, or a student's own
    BPE size (a ``module:callable`` takes none: it must have that many outputs)."""
    name, overrides = getattr(c.pair, role), getattr(c.overrides, role)
    return dict(overrides) if is_callable_name(name) else {**overrides, "vocab_size": vocab_of(c, role)}


def check_tokenizers(c: CellConfig) -> None:
    """A cell's ``data.tokenizers`` as the text protocol takes them: a byte-level teacher, and a student of its own
    tokenizer only as ``bpe:<N>`` (trained here on the training split) distilled by ``uld``."""
    t = c.data.tokenizers
    if t is None:
        return
    if t.teacher != "bytes":
        raise KdbenchError(
            f"quality (python-stdlib): data.tokenizers.teacher is {t.teacher!r}; the text protocol's teacher is "
            "byte-level (bytes), a student may have its own tokenizer"
        )
    if t.student != "bytes" and not t.student.startswith("bpe:"):
        raise KdbenchError(
            f"quality (python-stdlib): data.tokenizers.student {t.student!r} is a tokenizer file; the protocol "
            "trains the student's BPE on its own training split (bpe:<N>), so no held-out text is in it"
        )
    if t.student != "bytes" and c.method != "uld":
        raise KdbenchError(
            f"quality (python-stdlib): a student with its own tokenizer ({t.student}) is distilled by uld, whose "
            f"loss needs no shared vocabulary; method {c.method} compares distributions token by token"
        )


def window_alignment(
    kind: str, lengths: torch.Tensor, x: torch.Tensor, y: torch.Tensor, x_t: torch.Tensor, y_t: torch.Tensor
) -> Alignment | None:
    """ULD's rows of a batch of windows: the student's inputs and labels ``x``, ``y`` (its tokens' byte lengths
    ``lengths``), the byte teacher's ``x_t``, ``y_t``; None by position (the loss pairs them itself)."""
    if kind == "position":
        return None
    ones = torch.ones(BYTES, dtype=torch.long, device=x_t.device)
    return byte_alignment(y, y_t, next_token_offsets(x, lengths), next_token_offsets(x_t, ones))


def paired_share(
    kind: str, lengths: torch.Tensor, x: torch.Tensor, y: torch.Tensor, x_t: torch.Tensor, y_t: torch.Tensor
) -> float:
    """The share of the student's counted positions that ULD's ``kind`` alignment pairs on these windows."""
    align = window_alignment(kind, lengths, x, y, x_t, y_t)
    return matched_share(uld_alignment(y, y_t) if align is None else align, y)
