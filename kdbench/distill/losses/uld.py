"""Universal Logit Distillation for language models whose tokenizers differ (Boizard et al. 2024): the L1 distance
of the two sides' sorted next-token probability vectors, aligned by position after the prompt
(:mod:`kdbench.distill.lm.uld`, which holds the formulation and its sources), plus the CE on the student's own
tokens.  No shared vocabulary is needed."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.distill.lm.uld import uld_loss
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class ULDParams(Strict):
    # weight of the ULD term; 1 − alpha weighs the CE on the student's own next tokens. 0.6 keeps the authors'
    # ratio (CE 1, ULD 1.5: 0.4·CE + 0.6·ULD = 0.4·(CE + 1.5·ULD))
    alpha: float = Field(0.6, ge=0, le=1)
    # softmax temperature of both sides' probabilities (the authors' student and teacher temperatures; no T²)
    temperature: float = Field(1.0, gt=0, le=1000)
    # which positions of the two sides are paired: position (the authors' form: the i-th counted of each side) or
    # bytes (the positions that have read the same text, by the byte offsets of their tokens; needs real text,
    # data.tokenizers). kdbench.distill.lm.uld says why and how
    alignment: Literal["position", "bytes"] = "position"


@register_method("uld", ULDParams, doc="LM, any two tokenizers: L1 of sorted next-token probabilities + CE (ULD)")
class ULD(Term):
    """alpha × ULD of the student's and the teacher's logits, each side with its own labels (``inp.targets``: the
    student's; ``inp.teacher_targets``: the teacher's, the student's where absent), on the rows the step paired
    (``inp.alignment``: by ``params.alignment``) or else by position."""

    domain = "lm"
    # a term on each side's own tokens and vocabulary, over rows paired by position (LMLoss computes it with the
    # cell's loss_impl, never as a feature term)
    aligned_rows = True

    def __init__(self, params: ULDParams, shapes: Any = None):
        super().__init__()
        self.params = params
        self.ce_weight = 1.0 - params.alpha

    def forward(self, inp: LossInputs) -> torch.Tensor:
        p = self.params
        teacher_targets = inp.targets if inp.teacher_targets is None else inp.teacher_targets
        return p.alpha * uld_loss(
            inp.student_logits,
            inp.teacher_logits,
            inp.targets,
            teacher_targets,
            p.temperature,
            p.temperature,
            alignment=inp.alignment,
        )
