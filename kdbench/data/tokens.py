"""Seeded token batches: what the LM and encoder cells read when they read no text, and the prompt's length.

An LM batch (:func:`token_batch`) is ``batch_size`` sequences of ``seq_len`` token ids, uniform over the
vocabulary both models share, from the cell's seed; the labels are the next tokens, with the prompt (the first
``prompt_fraction`` of each sequence, :func:`prompt_tokens`) and the last position, which has no next token, set
to -100: not counted in any loss.  An encoder batch (:func:`encoder_batch`) is the ids alone, every position
attended; its targets are the ids.  Both are placed at the cell's ``alignment``
(:func:`kdbench.hw.layout.place_aligned`).
"""

from __future__ import annotations

from typing import Any

import torch

from kdbench.config.schema import CellConfig
from kdbench.core.names import IGNORE_INDEX
from kdbench.hw.layout import place_aligned


def prompt_tokens(seq_len: int, prompt_fraction: float) -> int:
    """Tokens of a ``seq_len``-token sequence's prompt: ``prompt_fraction`` of it, rounded, at most seq_len − 1."""
    return min(round(prompt_fraction * seq_len), seq_len - 1)


def prompt_length(config: CellConfig) -> int:
    """Tokens of each sequence's prompt in the cell: :func:`prompt_tokens` of ``data`` (at least 1 on-policy, which
    samples from it)."""
    prompt = prompt_tokens(config.data.seq_len, config.data.prompt_fraction)
    return max(prompt, 1) if config.on_policy is not None else prompt


def token_batch(
    batch_size: int, seq_len: int, vocab: int, prompt_fraction: float, seed: int, device: Any, config: CellConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, S) and next-token labels (B, S), the prompt share and the last position -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    labels[:, : prompt_tokens(seq_len, prompt_fraction)] = IGNORE_INDEX
    return place_aligned(ids.to(device), config.alignment), place_aligned(labels.to(device), config.alignment)


def encoder_batch(
    batch_size: int, seq_len: int, vocab: int, seed: int, device: Any, alignment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, S), uniform over ``vocab``, and the loss's targets: the ids, every position attended."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    return place_aligned(ids.to(device), alignment), place_aligned(ids.clone().to(device), alignment)
