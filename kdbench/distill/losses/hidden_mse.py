"""Hidden-state distillation for language models: MSE between the teacher's hidden states and the student's,
mapped to the teacher's width by a learned linear projection, on chosen decoder layers, over the valid tokens
(TinyBERT's hidden-state loss, Jiao et al. 2020; DistillKit's hidden-state mode).

The layers are ``features.teacher`` / ``features.student`` (decoder-layer module paths; by default decoder layers
evenly spaced through each model, paired deep end to deep end, as many as the shallower model has, at most 4).
Each projection is an adapter: it trains with the student (:class:`kdbench.distill.step.Trainee`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import nn

from kdbench.config.base import Strict
from kdbench.core.errors import KdbenchError
from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class HiddenMSEParams(Strict):
    """Hidden-state MSE through a learned projection: beta * mean over layers of MSE(proj(h_S), h_T) + CE."""

    # weight of the hidden-state term
    beta: float = Field(1.0, ge=0, le=1e7)


class _Projections(nn.Module):
    """One linear map per paired layer, on the channel axis of canonical (N, C, L) token features."""

    def __init__(self, student: list[torch.Size], teacher: list[torch.Size]):
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(s[1], t[1], bias=False) for s, t in zip(student, teacher))

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [m(f.transpose(1, 2)).transpose(1, 2) for m, f in zip(self.maps, feats)]


@register_method("hidden_mse", HiddenMSEParams, doc="LM: MSE(proj(student hidden), teacher hidden) on paired layers")
class HiddenMSE(Term):
    needs_features: ClassVar[bool] = True
    domain: ClassVar[str] = "lm"

    def __init__(self, params: HiddenMSEParams, shapes: Any):
        super().__init__()
        self.beta = params.beta
        for s, t in zip(shapes.student, shapes.teacher):
            if len(s) != 3 or len(t) != 3:
                raise KdbenchError(f"hidden_mse compares token features (N, C, L); got {tuple(s)} and {tuple(t)}")
        self.proj = _Projections(shapes.student, shapes.teacher)

    def adapter(self):
        return slice(None), self.proj

    def forward(self, inp: LossInputs) -> torch.Tensor:
        projected = inp.adapted["hidden_mse"]
        mask = (inp.targets != IGNORE_INDEX).float()  # (N, L): the valid tokens
        n = mask.sum().clamp_min(1.0)
        total = torch.zeros((), device=mask.device)
        for s, t in zip(projected, inp.teacher_feats):
            err = (s.float() - t.float()).pow(2).mean(dim=1)  # (N, L): mean over the teacher's channels
            total = total + (err * mask).sum() / n
        return self.beta * total / max(len(projected), 1)
