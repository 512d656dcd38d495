"""AT: Zagoruyko & Komodakis 2017, "Paying More Attention to Attention" (ICLR; their code and
mdistiller's ``AT``).

loss = beta/2 * sum over paired layers of d(Q_s, Q_t) + CE, with Q the normalised
attention map mean_c |A|^p of a feature; features of different sizes are average-pooled
to the smaller size before their maps are formed, as the reference implementations do.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.core.errors import KdbenchError
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class ATParams(Strict):
    """Attention transfer (Zagoruyko & Komodakis 2017) + CE."""

    # weight of the attention-transfer term (the paper's β; 1000 in Zagoruyko & Komodakis' code)
    beta: float = Field(1000.0, ge=0, le=1e9)
    # exponent of the attention map: the channel mean of |feature|^p
    p: float = Field(2.0, gt=0, le=16)
    form: Literal["code", "paper"] = "code"  # code: beta/2 * sum mean((Qs-Qt)^2); paper: beta/2 * sum mean ||Qs-Qt||_2


def attention_map(feature: torch.Tensor, p: float) -> torch.Tensor:
    """mean over channels of |A|^p, per sample, keeping its spatial shape (N, *spatial)."""
    return feature.float().abs().pow(p).mean(dim=1)


def _match_features(fs: torch.Tensor, ft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The larger of two features average-pooled to the smaller one's spatial size, before the attention
    maps are formed (as RepDistiller's and mdistiller's AT do).  Maps pool in 2-D (each side to the
    smaller of the two); a map against tokens, or tokens of two lengths, pool as sequences."""
    if fs.shape[2:] == ft.shape[2:]:
        return fs, ft
    if fs.dim() == ft.dim() == 4:
        size = (min(fs.shape[2], ft.shape[2]), min(fs.shape[3], ft.shape[3]))
        return F.adaptive_avg_pool2d(fs, size), F.adaptive_avg_pool2d(ft, size)
    fs, ft = fs.flatten(2), ft.flatten(2)  # (N, C, positions)
    n = min(fs.shape[2], ft.shape[2])
    return F.adaptive_avg_pool1d(fs, n), F.adaptive_avg_pool1d(ft, n)


def at_loss(
    student_feats: list[torch.Tensor],
    teacher_feats: list[torch.Tensor],
    beta: float,
    p: float = 2.0,
    form: str = "code",
) -> torch.Tensor:
    """beta/2 * sum over layers of the distance between normalised attention maps Q.

    Q = normalise(flatten(mean_c |A|^p)), of features pooled to a common size first
    (:func:`_match_features`).  `code`: mean((Qs - Qt)^2) over batch and positions
    (Zagoruyko's code); `paper`: the L2 norm ||Qs - Qt||_2, averaged over the batch.
    """
    total = student_feats[0].new_zeros((), dtype=torch.float32)
    for fs, ft in zip(student_feats, teacher_feats):
        if fs.dim() == 2 or ft.dim() == 2:
            raise KdbenchError(
                "method at needs spatial features (maps or tokens), got flat vectors; "
                "name other modules with features.teacher / features.student"
            )
        fs, ft = _match_features(fs, ft)
        q_s = F.normalize(attention_map(fs, p).flatten(1), dim=1)
        q_t = F.normalize(attention_map(ft, p).flatten(1), dim=1)
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
