"""DKD: Zhao et al. 2022, "Decoupled Knowledge Distillation" (CVPR; mdistiller's ``DKD``).

loss = min(step / warmup, 1) * (alpha * TCKD + beta * NCKD) + CE, where TCKD is the KL
of the binary (target, rest) distributions and NCKD the KL among the non-target
classes, each times T^2 and averaged over the batch.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class DKDParams(Strict):
    """Decoupled KD (Zhao et al. 2022): warm-up * (alpha * TCKD + beta * NCKD) + CE."""

    # weight of target-class KD (TCKD)
    alpha: float = Field(1.0, ge=0, le=1000)
    # weight of non-target-class KD (NCKD)
    beta: float = Field(8.0, ge=0, le=1000)
    # softening temperature (the terms are scaled by T²)
    temperature: float = Field(4.0, gt=0, le=1000)
    warmup: int = Field(20, ge=0, le=10_000_000)  # steps over which the DKD term ramps up linearly from 0


def _target_split(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log p_target, log (1 - p_target) and log-softmax over the non-target classes, all at T, stably."""
    z = logits.float() / temperature
    n, c = z.shape
    total = torch.logsumexp(z, dim=-1)
    z_target = z.gather(1, targets[:, None]).squeeze(1)
    # The non-target logits in class order, gathered by index: boolean-mask indexing would make the
    # host wait for the device (its output size is data-dependent) in every step.
    rest = torch.arange(c - 1, device=z.device).expand(n, c - 1)
    others = z.gather(1, rest + (rest >= targets[:, None]))
    log_others_sum = torch.logsumexp(others, dim=-1)
    log_p_target = z_target - total
    log_p_rest = log_others_sum - total  # log(1 - p_t) without forming 1 - p_t
    return log_p_target, log_p_rest, others - log_others_sum[:, None]


def dkd_parts(
    student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(TCKD, NCKD) of Zhao et al. 2022, each times T^2 and averaged over the batch.

    TCKD = KL of the binary (target, rest) distributions; NCKD = KL among the
    non-target classes.  KL(p_t || p_s) = TCKD + (1 - p_t^teacher) * NCKD, per sample.
    Computed from log-sum-exps in FP32: no log of a sum of probabilities.
    """
    s_t, s_r, s_o = _target_split(student, targets, temperature)
    t_t, t_r, t_o = _target_split(teacher, targets, temperature)
    tckd = t_t.exp() * (t_t - s_t) + t_r.exp() * (t_r - s_r)
    nckd = (t_o.exp() * (t_o - s_o)).sum(dim=-1)
    scale = temperature * temperature
    return scale * tckd.mean(), scale * nckd.mean()


@register_method("dkd", DKDParams, doc="Zhao et al. 2022: min(step/warmup,1)*(alpha*TCKD + beta*NCKD) + CE")
class DKD(Term):
    def __init__(self, params: DKDParams, shapes=None):
        super().__init__()
        self.alpha, self.beta, self.temperature, self.warmup = (
            params.alpha,
            params.beta,
            params.temperature,
            params.warmup,
        )

    def forward(self, inp: LossInputs) -> torch.Tensor:
        tckd, nckd = dkd_parts(inp.student_logits, inp.teacher_logits, inp.targets, self.temperature)
        ramp = min((inp.step + 1) / self.warmup, 1.0) if self.warmup else 1.0
        return ramp * (self.alpha * tckd + self.beta * nckd)
