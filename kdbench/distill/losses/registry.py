"""The method registry: a distillation method is a :class:`Term` registered with its parameters.

A method lives in one file of this package: its hyper-parameter model (a
:class:`kdbench.config.base.Strict` pydantic model whose defaults come from the
paper), its loss as a ``Term`` subclass, and a ``@register_method`` line tying the
two to a name.  The name is also the suite key of the parameters (``kd:
{temperature: 4}``); the suite schema builds its cell model from this registry, so
adding a method touches its own file only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.core.registry import Registry

# The training epoch the steps run in (1-based), set by a loop that trains over epochs (the quality
# protocol, :func:`kdbench.quality.train.fit`); None outside one: a timing cell's fixed batch has no epochs.
_EPOCH: ContextVar[int | None] = ContextVar("kdbench_training_epoch", default=None)


@contextlib.contextmanager
def training_epoch(epoch: int) -> Iterator[None]:
    """The steps inside run in training epoch ``epoch`` (1-based, as mdistiller's trainer counts): every
    :class:`LossInputs` made inside carries it, so a term whose schedule counts epochs (ReviewKD's warm-up)
    follows the epochs of a real training without the step's code knowing of them."""
    token = _EPOCH.set(epoch)
    try:
        yield
    finally:
        _EPOCH.reset(token)


@dataclass
class LossInputs:
    """What a step hands the loss: logits, labels, features, the step's index, and the training epoch."""

    student_logits: torch.Tensor
    teacher_logits: torch.Tensor
    targets: torch.Tensor
    student_feats: list[torch.Tensor] = field(default_factory=list)  # canonical (hooks.canonical)
    teacher_feats: list[torch.Tensor] = field(default_factory=list)
    adapted: dict[str, torch.Tensor] = field(default_factory=dict)  # a term's adapter output, by method name
    step: int = 0
    indices: torch.Tensor | None = None  # the batch's sample indices in its data set (None: a fixed batch)
    # The 1-based training epoch (inside :func:`training_epoch`: quality training); None: no epochs (a timing cell).
    epoch: int | None = field(default_factory=_EPOCH.get)
    # The teacher's own next-token labels where its tokenizer is not the student's (``data.tokenizers``; ULD);
    # None: the teacher reads the student's tokens and ``targets`` are both sides' labels.
    teacher_targets: torch.Tensor | None = None
    # The two sides' aligned rows (kdbench.distill.lm.uld.Alignment) where the step paired them (its align phase,
    # cross-tokenizer batches); None: the loss pairs them itself from the two sides' labels.
    alignment: Any = None


class Term(nn.Module):
    """One distillation term, built as ``cls(params, shapes)``; ``forward(LossInputs)`` returns the
    term without cross-entropy.  ``shapes`` holds the paired feature shapes of one dry forward
    pass (``FeaturePaths`` of ``torch.Size``) when the method ``needs_features``, else None."""

    needs_features: ClassVar[bool] = False
    # The pairs the method applies to: "image" (classifier logits and feature maps) or "lm" (causal language
    # models' next-token distributions and hidden states, :mod:`kdbench.distill.lm`) or "encoder" (BERT-shaped
    # encoders' attention relations, :mod:`kdbench.distill.encoder`).
    domain: ClassVar[str] = "image"
    ce_weight: float = 1.0

    def adapter(self) -> tuple[int | slice, nn.Module] | None:
        """(feature index, module) applied to the student's feature inside the student's forward (a slice
        hands the module a list of features, e.g. every paired one for ReviewKD's fusion).

        The student side owns it (``step.Trainee``): it trains with the student, counts
        in its parameters and, under DDP, has its gradients reduced with the student's.
        """
        return None


@dataclass(frozen=True)
class Method:
    name: str  # also the suite key of its parameters
    cls: type[Term]
    params: type[BaseModel]  # the hyper-parameter model; its defaults are the method's
    doc: str


def _unknown_method(part: str) -> str:
    short = [m for m in METHODS if part.lower().replace("-", "_") in (m, _abbreviation(m))]
    hint = f"did you mean {short[0]}? " if short else did_you_mean(part, METHODS, cutoff=0.5)
    return (
        f"unknown method '{part}'; {hint}(`kdbench list methods` shows all: {', '.join(sorted(METHODS))}; "
        "combine with '+')"
    )


METHODS: Registry[Method] = Registry("method", unknown=_unknown_method)


def register_method(name: str, params: type[BaseModel], doc: str) -> Callable[[type[Term]], type[Term]]:
    """Register a Term class as method ``name`` with its hyper-parameter model."""

    def wrap(cls: type[Term]) -> type[Term]:
        METHODS.register(name, Method(name, cls, params, doc))
        return cls

    return wrap


def method_parts(name: str) -> list[str]:
    return [p.strip() for p in name.split("+")]


def _abbreviation(name: str) -> str:
    """How papers shorten a method's name: the initials of its words but the last (forward_kl: fkl)."""
    words = name.split("_")
    return "".join(w[0] for w in words[:-1]) + words[-1]


def check_method(name: str) -> list[Method]:
    """The registered methods of `name` (`kd`, `kd+at`, ...); KdbenchError for an unknown or repeated part."""
    parts = method_parts(name)
    if len(set(parts)) != len(parts):
        raise KdbenchError(f"method '{name}' repeats a term; give each at most once (weights sets their size)")
    return [METHODS.find(part) for part in parts]


def check_weights(method: str, weights: dict[str, float]) -> None:
    parts = method_parts(method)
    for key, value in weights.items():
        if key not in parts:
            raise KdbenchError(f"weights.{key}: '{key}' is not a term of method '{method}'; use one of {parts}")
        if not math.isfinite(value) or value < 0:
            raise KdbenchError(f"weights.{key}: must be a finite number >= 0, got {value}")


def needs_features(method: str) -> bool:
    return any(m.cls.needs_features for m in check_method(method))


def params_of(config: Any, method: Method) -> BaseModel:
    """The cell's parameters of ``method`` (its suite key)."""
    return getattr(config, method.name)
