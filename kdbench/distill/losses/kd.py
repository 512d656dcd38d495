"""KD: Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural Network" (arXiv:1503.02531).

loss = alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y), the KL
averaged over the batch (``batchmean``), as mdistiller's ``KD`` and torchdistill's
``KDLoss`` compute it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class KDParams(Strict):
    """Hinton KD: alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE."""

    # softening temperature T of both distributions (the KL is scaled by T²)
    temperature: float = Field(4.0, gt=0, le=1000)
    # weight of the KD term; 1 − alpha weighs the cross-entropy with the labels
    alpha: float = Field(0.9, ge=0, le=1)


def kd_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(t/T) || softmax(s/T)), averaged over the batch (in FP32)."""
    s, t = student.float(), teacher.float()
    kl = F.kl_div(
        F.log_softmax(s / temperature, dim=-1),
        F.log_softmax(t / temperature, dim=-1),
        reduction="batchmean",
        log_target=True,
    )
    return temperature * temperature * kl


def kd_loss(
    student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, temperature: float, alpha: float
) -> torch.Tensor:
    """alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y); KL averaged over the batch."""
    with torch.amp.autocast(device_type=student.device.type, enabled=False):
        return alpha * kd_kl(student, teacher, temperature) + (1.0 - alpha) * F.cross_entropy(student.float(), targets)


@register_method("kd", KDParams, doc="Hinton et al. 2015: alpha*T^2*KL(teacher||student) + (1-alpha)*CE")
class KD(Term):
    def __init__(self, params: KDParams, shapes=None):
        super().__init__()
        self.temperature, self.alpha = params.temperature, params.alpha
        self.ce_weight = 1.0 - self.alpha

    def forward(self, inp: LossInputs) -> torch.Tensor:
        return self.alpha * kd_kl(inp.student_logits, inp.teacher_logits, self.temperature)
