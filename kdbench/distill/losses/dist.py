"""DIST: Huang, You, Wang, Qian & Xu 2022, "Knowledge Distillation from A Stronger Teacher"
(NeurIPS; arXiv:2205.10536; code: hunto/DIST_KD, loss in hunto/image_classification_sota
``lib/models/losses/dist_kd.py``).  mdistiller has no DIST.

loss = beta * tau^2 * L_inter + gamma * tau^2 * L_intra + CE, with p = softmax(logits / tau):

* L_inter = 1 - mean over samples i of pearson(p_s[i, :], p_t[i, :]) (across the classes);
* L_intra = 1 - mean over classes c of pearson(p_s[:, c], p_t[:, c]) (across the batch);

pearson(a, b) = <a - mean a, b - mean b> / (||a - mean a|| * ||b - mean b|| + 1e-8), as the
authors' code computes it.

Defaults: the authors' ImageNet recipe (``configs/strategies/distill/resnet_dist.yaml``:
``kd: dist``, i.e. ``DIST(beta=1, gamma=1, tau=1)`` weighted by ``kd_loss_weight: 2.``,
``ori_loss_weight: 1.``), so beta = gamma = 2, tau = 1 and a CE weight of 1 (every
authors' config weights the DIST term by 2).  Their CIFAR-100 recipe (``dist_cifar.yaml``:
``kd: dist_t4``) differs only in tau = 4; set ``dist: {tau: 4}`` for it.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class DISTParams(Strict):
    """DIST (Huang et al. 2022): tau^2 * (beta * inter-class + gamma * intra-class (1 - Pearson)) + CE."""

    beta: float = Field(2.0, ge=0, le=1e7)  # inter-class relation (per sample, across classes)
    gamma: float = Field(2.0, ge=0, le=1e7)  # intra-class relation (per class, across the batch)
    # temperature of both softmaxes (the relations are scaled by tau²)
    tau: float = Field(1.0, gt=0, le=1000)


def pearson_rows(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Pearson correlation of each row of ``a`` with the same row of ``b`` (the authors' form, eps added)."""
    a = a - a.mean(dim=1, keepdim=True)
    b = b - b.mean(dim=1, keepdim=True)
    return (a * b).sum(dim=1) / (a.norm(dim=1) * b.norm(dim=1) + eps)


def dist_parts(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(inter, intra) of Huang et al. 2022, each times tau^2, from (N, K) logits, in FP32."""
    p_s = torch.softmax(student.float() / tau, dim=1)
    p_t = torch.softmax(teacher.detach().float() / tau, dim=1)
    scale = tau * tau
    inter = 1 - pearson_rows(p_s, p_t).mean()
    intra = 1 - pearson_rows(p_s.t(), p_t.t()).mean()
    return scale * inter, scale * intra


@register_method("dist", DISTParams, doc="Huang et al. 2022: tau^2*(beta*(1-inter Pearson) + gamma*(1-intra)) + CE")
class DIST(Term):
    def __init__(self, params: DISTParams, shapes=None):
        super().__init__()
        self.beta, self.gamma, self.tau = params.beta, params.gamma, params.tau

    def forward(self, inp: LossInputs) -> torch.Tensor:
        inter, intra = dist_parts(inp.student_logits, inp.teacher_logits, self.tau)
        return self.beta * inter + self.gamma * intra
