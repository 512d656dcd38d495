"""Distillation losses: the method registry, one file per method, and the cell's whole loss.

Every module of this package is imported here, so a method registers itself by
existing (see :mod:`kdbench.distill.losses.registry`).  ``method: a+b`` combines terms:

    loss = ce_weight * CE(student, labels) + sum_m weights[m] * term_m

``ce_weight`` is the smallest of the terms' own CE weights: ``1 - alpha`` when
``kd`` is a term (Hinton's form), else 1.  ``weights`` (a suite key) defaults to 1.

Every loss is computed in FP32 with autocast disabled, whatever precision the
forward passes ran in: softmax at temperature T in half precision loses the small
probabilities that distillation transfers.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kdbench.distill.losses.registry import (
    METHODS,
    LossInputs,
    Method,
    Term,
    check_method,
    check_weights,
    method_parts,
    needs_features,
    params_of,
    register_method,
)
from kdbench.hw.layout import unpad

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")


class WeightedTerms(nn.Module):
    """The cell's method terms, built with their parameters, their ``weights`` and the CE weight: what every
    family's whole loss starts from (image classifiers: :class:`DistillLoss`; LMs: ``distill.lm.loss.LMLoss``;
    encoders: ``distill.encoder.EncoderLoss``)."""

    def __init__(self, config: Any, shapes: Any = None):
        super().__init__()
        methods = check_method(config.method)
        check_weights(config.method, config.weights)
        self.names = [m.name for m in methods]
        self.terms = nn.ModuleList(m.cls(params_of(config, m), shapes) for m in methods)
        self.weights = [float(config.weights.get(n, 1.0)) for n in self.names]
        self.ce_weight = min(t.ce_weight for t in self.terms)
        self.needs_features = any(t.needs_features for t in self.terms)


class DistillLoss(WeightedTerms):
    """The cell's whole loss: ce_weight * CE + sum of weighted terms, in FP32 with autocast off."""

    def __init__(self, config: Any, shapes: Any = None):
        super().__init__(config, shapes)
        self.num_classes = config.data.num_classes  # a padded classifier's extra columns stay out of the loss

    def forward(self, inp: LossInputs):
        n = self.num_classes
        inp = dataclasses.replace(
            inp, student_logits=unpad(inp.student_logits, n), teacher_logits=unpad(inp.teacher_logits, n)
        )
        with torch.amp.autocast(device_type=inp.student_logits.device.type, enabled=False):
            loss = self.ce_weight * F.cross_entropy(inp.student_logits.float(), inp.targets)
            for weight, term in zip(self.weights, self.terms):
                loss = loss + weight * term(inp)
            return loss


__all__ = [
    "METHODS",
    "DistillLoss",
    "LossInputs",
    "Method",
    "Term",
    "WeightedTerms",
    "check_method",
    "check_weights",
    "method_parts",
    "needs_features",
    "register_method",
]
