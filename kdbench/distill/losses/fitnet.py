"""FitNet: Romero et al. 2015, "FitNets: Hints for Thin Deep Nets" (ICLR; mdistiller's ``FitNet``),
one stage.

loss = beta * MSE(regressor(student hint), teacher hint) + CE.  The regressor is an
adapter: it trains with the student (``step.Trainee``) and is shaped by one dry
forward pass, so any teacher/student pair works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kdbench.config.base import Strict
from kdbench.core.errors import KdbenchError
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class FitNetParams(Strict):
    """FitNets (Romero et al. 2015), one stage: beta * MSE(regressor(student hint), teacher hint) + CE."""

    # weight of the hint (feature regression) term
    beta: float = Field(100.0, ge=0, le=1e7)
    hint_layer: int | None = Field(None, ge=-64, le=63)  # index into the paired feature lists; null: the middle one


def regressor(student_shape: torch.Size, teacher_shape: torch.Size) -> nn.Module:
    """A module taking the student's canonical hint feature to the teacher's shape.

    Maps: conv-BN-ReLU, with a stride when the student's map is an integer multiple
    of the teacher's, a transposed conv when it is an integer fraction, and adaptive
    pooling (or interpolation) otherwise.  Tokens and vectors: a linear layer on the
    channels (tokens resampled along their length when it differs).  A map against
    tokens or vectors: both are globally pooled and a linear layer maps the channels.
    """
    cs, ct = student_shape[1], teacher_shape[1]
    if len(student_shape) == len(teacher_shape) == 4:
        return _MapRegressor(cs, ct, tuple(student_shape[2:]), tuple(teacher_shape[2:]))
    if len(student_shape) == len(teacher_shape) == 3:
        return _SeqRegressor(cs, ct, teacher_shape[2])
    return _PooledRegressor(cs, ct)


class _MapRegressor(nn.Module):
    def __init__(self, cs: int, ct: int, s_hw: tuple[int, int], t_hw: tuple[int, int]):
        super().__init__()
        self.size = t_hw
        (sh, sw), (th, tw) = s_hw, t_hw
        if (sh, sw) == (th, tw):
            conv: nn.Module = nn.Conv2d(cs, ct, 3, padding=1, bias=False)
        elif sh % th == 0 and sw % tw == 0 and sh // th == sw // tw:
            r = sh // th
            conv = nn.Conv2d(cs, ct, 3, stride=r, padding=1, bias=False)
        elif th % sh == 0 and tw % sw == 0 and th // sh == tw // sw:
            r = th // sh
            conv = nn.ConvTranspose2d(cs, ct, r, stride=r, bias=False)
        else:
            conv = nn.Conv2d(cs, ct, 3, padding=1, bias=False)
        self.body = nn.Sequential(conv, nn.BatchNorm2d(ct), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if tuple(y.shape[2:]) != self.size:
            larger = y.shape[2] >= self.size[0] and y.shape[3] >= self.size[1]
            y = F.adaptive_avg_pool2d(y, self.size) if larger else F.interpolate(y, size=self.size, mode="bilinear")
        return y


class _SeqRegressor(nn.Module):
    def __init__(self, cs: int, ct: int, length: int):
        super().__init__()
        self.length = length
        self.linear = nn.Linear(cs, ct)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, L)
        y = self.linear(x.transpose(1, 2)).transpose(1, 2)
        return y if y.shape[2] == self.length else F.adaptive_avg_pool1d(y, self.length)


class _PooledRegressor(nn.Module):
    def __init__(self, cs: int, ct: int):
        super().__init__()
        self.linear = nn.Linear(cs, ct)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(2).mean(dim=2) if x.dim() > 2 else x)


def pooled(t: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (N, C): the global average a pooled regressor is compared against."""
    return t.flatten(2).mean(dim=2) if t.dim() > 2 else t


@register_method(
    "fitnet", FitNetParams, doc="Romero et al. 2015 (one stage): beta*MSE(regressor(student hint), teacher hint) + CE"
)
class FitNet(Term):
    needs_features = True

    def __init__(self, params: FitNetParams, shapes):
        super().__init__()
        n = len(shapes.teacher)
        index = params.hint_layer if params.hint_layer is not None else n // 2
        if not -n <= index < n:
            raise KdbenchError(f"fitnet.hint_layer: {index} is outside the {n} paired features; use 0..{n - 1}")
        self.index = index % n
        self.beta = params.beta
        self._regressor = [regressor(shapes.student[self.index], shapes.teacher[self.index])]  # owned by the student
        self.pool_target = len(shapes.student[self.index]) != len(shapes.teacher[self.index])

    def adapter(self) -> tuple[int, nn.Module]:
        return self.index, self._regressor[0]

    def forward(self, inp: LossInputs) -> torch.Tensor:
        hint = inp.adapted["fitnet"].float()
        target = inp.teacher_feats[self.index].float()
        if self.pool_target:
            target = pooled(target)
        return self.beta * F.mse_loss(hint, target)
