"""Distillation losses, in a registry filled by a decorator.

A method is a function ``(student_logits, teacher_logits, targets, config) -> loss``.
Losses are computed in FP32 with autocast disabled, whatever precision the
forward passes ran in: softmax at temperature T in half precision loses the small
probabilities that distillation transfers.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kdbench.errors import KdbenchError

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass(frozen=True)
class Method:
    name: str
    fn: LossFn
    params: str  # the suite key holding its hyper-parameters
    doc: str


METHODS: dict[str, Method] = {}


def register_method(name: str, params: str, doc: str) -> Callable[[LossFn], LossFn]:
    def wrap(fn: LossFn) -> LossFn:
        METHODS[name] = Method(name, fn, params, doc)
        return fn

    return wrap


def check_method(name: str) -> Method:
    if name in METHODS:
        return METHODS[name]
    close = difflib.get_close_matches(name, list(METHODS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise KdbenchError(f"unknown method '{name}'; {hint}(`kdbench list methods` shows all: {', '.join(sorted(METHODS))})")


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, temperature: float, alpha: float) -> torch.Tensor:
    """alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y); KL averaged over the batch."""
    device_type = student.device.type
    with torch.amp.autocast(device_type=device_type, enabled=False):
        s = student.float()
        t = teacher.float()
        soft = F.kl_div(
            F.log_softmax(s / temperature, dim=-1),
            F.log_softmax(t / temperature, dim=-1),
            reduction="batchmean",
            log_target=True,
        )
        hard = F.cross_entropy(s, targets)
        return alpha * temperature * temperature * soft + (1.0 - alpha) * hard


@register_method("kd", params="kd", doc="Hinton et al. 2015: alpha*T^2*KL(teacher||student) + (1-alpha)*CE")
def _kd(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, config: Any) -> torch.Tensor:
    return kd_loss(student, teacher, targets, config.kd.temperature, config.kd.alpha)
