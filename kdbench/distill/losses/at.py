"""AT: Zagoruyko & Komodakis 2017, "Paying More Attention to Attention" (ICLR; their code and
mdistiller's ``AT``).

loss = beta/2 * sum over paired layers of d(Q_s, Q_t) + CE, with Q the normalised
attention map mean_c |A|^p of a feature.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.distill.losses.registry import LossInputs, Term, register_method
from kdbench.errors import KdbenchError


class ATParams(Strict):
    """Attention transfer (Zagoruyko & Komodakis 2017) + CE."""

    beta: float = Field(1000.0, ge=0, le=1e9)
    p: float = Field(2.0, gt=0, le=16)
    form: Literal["code", "paper"] = "code"  # code: beta/2 * sum mean((Qs-Qt)^2); paper: beta/2 * sum mean ||Qs-Qt||_2


def attention_map(feature: torch.Tensor, p: float) -> torch.Tensor:
    """mean over channels of |A|^p, per sample, keeping its spatial shape (N, *spatial)."""
    return feature.float().abs().pow(p).mean(dim=1)


def _match_spatial(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Average-pool the larger of two attention maps to the smaller one's size."""
    if a.shape[1:] == b.shape[1:]:
        return a, b
    if a.dim() == b.dim() == 3:  # 2-D maps
        size = (min(a.shape[1], b.shape[1]), min(a.shape[2], b.shape[2]))
        return F.adaptive_avg_pool2d(a[:, None], size)[:, 0], F.adaptive_avg_pool2d(b[:, None], size)[:, 0]
    a, b = a.flatten(1), b.flatten(1)  # a map against tokens: compare as sequences
    n = min(a.shape[1], b.shape[1])
    return F.adaptive_avg_pool1d(a[:, None], n)[:, 0], F.adaptive_avg_pool1d(b[:, None], n)[:, 0]


def at_loss(
    student_feats: list[torch.Tensor],
    teacher_feats: list[torch.Tensor],
    beta: float,
    p: float = 2.0,
    form: str = "code",
) -> torch.Tensor:
    """beta/2 * sum over layers of the distance between normalised attention maps Q.

    Q = normalise(flatten(mean_c |A|^p)).  `code`: mean((Qs - Qt)^2) over batch and
    positions (Zagoruyko's code); `paper`: the L2 norm ||Qs - Qt||_2, averaged over the batch.
    """
    total = student_feats[0].new_zeros((), dtype=torch.float32)
    for fs, ft in zip(student_feats, teacher_feats):
        if fs.dim() == 2 or ft.dim() == 2:
            raise KdbenchError(
                "method at needs spatial features (maps or tokens), got flat vectors; "
                "name other modules with features.teacher / features.student"
            )
        a_s, a_t = _match_spatial(attention_map(fs, p), attention_map(ft, p))
        q_s = F.normalize(a_s.flatten(1), dim=1)
        q_t = F.normalize(a_t.flatten(1), dim=1)
        diff = q_s - q_t
        total = total + (diff.pow(2).mean() if form == "code" else diff.norm(dim=1).mean())
    return beta / 2 * total


@register_method("at", ATParams, doc="Zagoruyko & Komodakis 2017: beta/2*sum_layers d(Q_s, Q_t) + CE")
class AT(Term):
    needs_features = True

    def __init__(self, params: ATParams, shapes=None):
        super().__init__()
        self.beta, self.p, self.form = params.beta, params.p, params.form

    def forward(self, inp: LossInputs) -> torch.Tensor:
        return at_loss(inp.student_feats, inp.teacher_feats, self.beta, self.p, self.form)
