"""What a loss implementation is: the :class:`LossImpl` record, the registry of them (:data:`IMPLS`), what
each computes on (:class:`Heads`) and with (:class:`Settings`), and what it holds (:class:`Buffers`).

Each implementation is one module of this package that builds its record and calls :func:`register_impl`;
the package imports them in the order of :data:`kdbench.distill.lm.impls.LOSS_IMPLS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from kdbench.core.registry import Registry
from kdbench.distill.lm.divergences import TokenLoss

__all__ = [
    "IMPLS",
    "AlignedHeads",
    "Buffers",
    "HeadTensors",
    "Heads",
    "LossImpl",
    "Settings",
    "get_impl",
    "register_impl",
]


@dataclass(frozen=True)
class HeadTensors:
    """The six tensors every LM loss computes on: each model's final hidden states, flattened to its positions, and
    its LM head (weight, bias or None); the teacher's are constants (detached)."""

    student_hidden: torch.Tensor
    student_weight: torch.Tensor
    student_bias: torch.Tensor | None
    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor
    teacher_bias: torch.Tensor | None

    def tensors(self) -> tuple:
        """The six, in their order: the student's hidden states, head weight and bias, then the teacher's."""
        return tuple(getattr(self, f.name) for f in fields(HeadTensors))

    @property
    def may_inf(self) -> bool:
        """Whether a logit can be infinite, decided on the host (no value is read): only an infinite bias (a
        padded vocabulary's -inf) makes one, so heads without a bias make none."""
        return self.student_bias is not None or self.teacher_bias is not None


@dataclass(frozen=True)
class Heads(HeadTensors):
    """The token loss's inputs, flattened to tokens: each model's final hidden states (N, H), its LM head
    (weight (V, H), bias (V,) or None) and the labels (N,), long, -100 (``IGNORE_INDEX``) = not counted.
    The teacher's tensors are constants (detached)."""

    labels: torch.Tensor


@dataclass(frozen=True)
class AlignedHeads(HeadTensors):
    """ULD's inputs (:mod:`kdbench.distill.lm.uld`): each model's final hidden states flattened to its own
    positions (N_s, H_s) and (N_t, H_t), its whole LM head (its own vocabulary), the aligned rows (an
    :class:`~kdbench.distill.lm.uld.Alignment`: flat row indices into each side, each row's weight) and each
    side's temperature.  The teacher's tensors are constants (detached)."""

    alignment: Any
    student_temperature: float = 1.0
    teacher_temperature: float = 1.0


@dataclass(frozen=True)
class Settings:
    """How to compute: ``chunk_size`` tokens per chunk (every impl but dense and natural), and liger's ``compiled``."""

    chunk_size: int = 1024
    liger_compiled: bool = False


@dataclass(frozen=True)
class Buffers:
    """The logits-sized buffers an implementation holds at its peak: ``full`` (n_tokens, V) ones and ``chunk``
    (``rows``, V) ones, each part (count, bytes per entry, what they are); a count None: not counted."""

    full: tuple[tuple[float | None, int, str], ...]
    chunk: tuple[tuple[float | None, int, str], ...] = ()
    rows: int = 0


def _every(loss: TokenLoss) -> str | None:
    return None


def _here() -> str | None:
    return None


def _silent() -> str:
    return ""


@dataclass(frozen=True)
class LossImpl:
    """One implementation of "LM heads + token loss".

    ``compute(heads, loss, rows, settings)``: ``ce_weight · CE + kd_weight · D`` of the valid tokens (``rows``:
    their indices in ``heads``), a float32 scalar differentiable w.r.t. the student's hidden states and head.
    ``unsupported(loss)``: None when it computes ``loss`` (a TokenLoss with a divergence), else why and what
    to use instead; pure logic, usable at plan time.  ``unavailable()``: None when it runs in this
    environment, else why and the fix.  ``buffers(loss, n_tokens, chunk_size, dtype_bytes)``: its
    logits-sized buffers at its peak over ``n_tokens`` tokens (:mod:`kdbench.distill.lm.impls.memory`);
    ``valid_only``: they span the valid tokens alone (its heads run on those), else every token of the batch.
    ``note()``: what a step row computed with it must say (a host-device sync it makes), "" for nothing.
    ``needs``: what it needs beyond kdbench's own dependencies, in words ("" for nothing: ``kdbench list
    loss_impls`` says it with whether this environment has it, from ``unavailable()``).
    ``uld(heads, settings)``: ULD's term (:mod:`kdbench.distill.lm.uld`) of :class:`AlignedHeads`, a float32
    scalar differentiable w.r.t. the student's hidden states and head; None: this implementation cannot compute
    it (``uld_why`` says why), and a ``uld`` cell under it is refused at plan time.  ``inf_why``: why it cannot
    take -inf logits (a padded vocabulary), "" where it leaves the infinite entries out as token_losses defines.
    """

    name: str
    compute: Callable[[Heads, TokenLoss, torch.Tensor, Settings], torch.Tensor]
    buffers: Callable[[TokenLoss, int, int, int], Buffers]
    unsupported: Callable[[TokenLoss], str | None] = _every
    unavailable: Callable[[], str | None] = _here
    valid_only: bool = True
    note: Callable[[], str] = _silent
    needs: str = ""
    uld: Callable[[AlignedHeads, Settings], torch.Tensor] | None = None
    uld_why: str = ""
    inf_why: str = ""  # why it cannot take -inf logits (data.vocab_policy: pad); "": it leaves them out


IMPLS: Registry[LossImpl] = Registry(
    "loss implementation", unknown=lambda name: f"unknown LM loss implementation {name!r}: {IMPLS.choose(name)}"
)


def register_impl(impl: LossImpl) -> LossImpl:
    """Add ``impl`` to :data:`IMPLS` under its name (a name may be registered once)."""
    return IMPLS.register(impl.name, impl)


def get_impl(name: str) -> LossImpl:
    """The registered implementation ``name``; a KdbenchError naming the registered ones otherwise."""
    return IMPLS.find(name)
