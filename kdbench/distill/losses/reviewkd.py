"""ReviewKD: Chen et al. 2021, "Distilling Knowledge via Knowledge Review" (CVPR; dvlab-research/ReviewKD's
``CIFAR-100/model/reviewkd.py`` and mdistiller's ``ReviewKD``).

loss = weight * min(epoch / warmup, 1) * sum_i HCL(ABF-fused student feature i, teacher feature i) + CE.

The student's paired features are reviewed from the deepest to the shallowest: the
deepest goes through its ABF alone (1x1 conv to ``mid`` channels + BN, then 3x3 conv
+ BN to the teacher's channels); each shallower one is brought to ``mid`` channels,
fused with the residual of the deeper stage (nearest-upsampled to its size) by a
two-channel sigmoid attention computed from their concatenation, resized (nearest) to
the teacher's spatial size and mapped to the teacher's channels.  HCL is the MSE at
full size plus the MSEs after adaptive average pooling to 4, 2 and 1 (each only when
smaller than the map), weighted 1, 1/2, 1/4, 1/8 and divided by the sum of the weights.

Defaults (the references'): weight 1.0 and warm-up 20 epochs (mdistiller ``CFG.REVIEWKD``:
``REVIEWKD_WEIGHT 1.0``, ``WARMUP_EPOCHS 20``; dvlab's ``--kd-warm-up 20``; the references'
CIFAR scripts set weight 5.0 for resnet32x4 -> resnet8x4, 0.6 for resnet56 -> resnet20), CE
weight 1.0, and mid channels ``min(512, channels of the student's deepest feature)``
(``mid_channel = min(512, in_channels[-1])`` in both; 256 for resnet8x4).

The warm-up counts epochs, as mdistiller's: ``min(epoch / warmup, 1)`` with the first epoch 1
(its trainer counts ``epoch = 1 .. EPOCHS``), so the term has 1/20 of its weight in the first
epoch and all of it from epoch 20 on.  (dvlab's CIFAR ``train.py`` counts ``for epoch in
range(epochs)`` from 0: there the first epoch has weight 0 and full weight comes one epoch
later.)  The epoch comes from ``LossInputs.epoch``, which the quality training sets
(:func:`kdbench.distill.losses.registry.training_epoch`).  A timing cell's fixed batch has no
epochs (``epoch`` None): it runs the term at full weight, as the bulk of a training after the
warm-up does; the step's cost does not depend on the ramp's value.

Differences from the references: the reviewed levels are the paired features kdbench
captures (``features.teacher`` / ``features.student``); the references add the pooled
feature (1x1) as the deepest level and take the teacher's pre-activation stage outputs,
which kdbench's hooks do not see unless those modules are named as features.  Channels
and spatial sizes (non-square too) come from one dry forward pass (``shapes``), so any
pair of convolutional networks works.

The ABFs are one adapter (``step.Trainee``) that trains with the student.  Trainee
applies an adapter to ``feats[index]``; this term's index is ``slice(None)``, so its
adapter receives the whole list of the student's paired features (a copy of the list)
and returns the list of fused features, with no change to ``step.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from kdbench.config.base import Strict
from kdbench.core.errors import KdbenchError
from kdbench.distill.losses.registry import LossInputs, Term, register_method

MAX_MID_CHANNELS = 512  # the references' cap: mid_channel = min(512, in_channels[-1])
MAX_WARMUP_EPOCHS = 10_000  # the most epochs a quality training runs (QualityConfig.epochs)
HCL_LEVELS = (4, 2, 1)  # the pooled sizes of HCL


class ReviewKDParams(Strict):
    """ReviewKD (Chen et al. 2021): weight * warm-up * sum HCL(ABF(student features), teacher features) + CE."""

    # weight of the review (hierarchical context) loss
    weight: float = Field(1.0, ge=0, le=1e7)
    mid_channels: int | None = Field(None, ge=1, le=8192)  # null: min(512, the student's deepest channels)
    # Epochs of a training over which the term ramps up linearly, min(epoch / warmup, 1) with the first epoch 1
    # (mdistiller's WARMUP_EPOCHS); 0: no ramp.  Quality training counts its epochs; a timing cell (a fixed
    # batch, no epochs) runs the term at full weight, as after the warm-up: a step costs the same at any ramp.
    warmup: int = Field(20, ge=0)

    @field_validator("warmup")
    @classmethod
    def _epochs(cls, v: int) -> int:
        if v > MAX_WARMUP_EPOCHS:
            raise ValueError(
                f"reviewkd.warmup counts epochs (mdistiller's WARMUP_EPOCHS, 20), not steps: at most "
                f"{MAX_WARMUP_EPOCHS} (quality.epochs' limit), got {v}"
            )
        return v


def hcl_loss(student_feats: list[torch.Tensor], teacher_feats: list[torch.Tensor]) -> torch.Tensor:
    """Hierarchical context loss, summed over the levels, in FP32.

    Per level: MSE at full size, plus MSE of both maps adaptive-average-pooled to l x l
    for l in 4, 2, 1 (skipped when l >= the map's height, as in the references), the
    k-th pooled term weighted 2^-k; the sum is divided by the sum of the weights used.
    """
    total = student_feats[0].new_zeros((), dtype=torch.float32)
    for fs, ft in zip(student_feats, teacher_feats):
        fs, ft = fs.float(), ft.float()
        h = fs.shape[2]
        loss = F.mse_loss(fs, ft)
        weight = weights = 1.0
        for size in HCL_LEVELS:
            if size >= h:
                continue
            weight /= 2.0
            loss = loss + weight * F.mse_loss(F.adaptive_avg_pool2d(fs, size), F.adaptive_avg_pool2d(ft, size))
            weights += weight
        total = total + loss / weights
    return total


class ABF(nn.Module):
    """Attention-based fusion of one student stage with the residual of the deeper one (the references' ABF).

    ``forward(x, residual)`` returns (output at the teacher's channels and ``out_size``,
    the new residual at ``mid`` channels and ``out_size``).
    """

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int, fuse: bool, out_size: tuple[int, int]):
        super().__init__()
        self.out_size = out_size
        self.conv1 = nn.Sequential(
            nn.Conv2d(in_channels, mid_channels, kernel_size=1, bias=False), nn.BatchNorm2d(mid_channels)
        )
        self.conv2 = nn.Sequential(
            nn.Conv2d(mid_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.att_conv = nn.Sequential(nn.Conv2d(mid_channels * 2, 2, kernel_size=1), nn.Sigmoid()) if fuse else None
        nn.init.kaiming_uniform_(self.conv1[0].weight, a=1)
        nn.init.kaiming_uniform_(self.conv2[0].weight, a=1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv1(x)
        if self.att_conv is not None:
            assert residual is not None
            residual = F.interpolate(residual, size=tuple(x.shape[2:]), mode="nearest")
            z = self.att_conv(torch.cat([x, residual], dim=1))
            x = x * z[:, 0:1] + residual * z[:, 1:2]
        if tuple(x.shape[2:]) != self.out_size:
            x = F.interpolate(x, size=self.out_size, mode="nearest")
        return self.conv2(x), x


class ReviewFusion(nn.Module):
    """The ABFs of all paired levels, as one adapter: the list of student features (shallow to deep) in,
    the list of fused features at the teacher's shapes (same order) out.  ``abfs[i]`` serves level i."""

    def __init__(self, student_shapes: list[torch.Size], teacher_shapes: list[torch.Size], mid_channels: int | None):
        super().__init__()
        mid = mid_channels if mid_channels is not None else min(MAX_MID_CHANNELS, int(student_shapes[-1][1]))
        last = len(student_shapes) - 1
        self.abfs = nn.ModuleList(
            ABF(int(s[1]), mid, int(t[1]), i < last, (int(t[2]), int(t[3])))
            for i, (s, t) in enumerate(zip(student_shapes, teacher_shapes))
        )

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [feats[0]] * len(feats)  # every slot is overwritten below
        residual: torch.Tensor | None = None
        for i in range(len(feats) - 1, -1, -1):  # deepest first
            out[i], residual = self.abfs[i](feats[i], residual)
        return out


def _check_maps(shapes) -> None:
    for role in ("student", "teacher"):
        for i, shape in enumerate(getattr(shapes, role)):
            if len(shape) != 4:
                kind = "token (N, C, L)" if len(shape) == 3 else f"{len(shape)}-D"
                raise KdbenchError(
                    f"method reviewkd needs feature maps (N, C, H, W); the {role}'s paired feature {i} is a "
                    f"{kind} feature {tuple(shape)}: use a CNN pair or name map-shaped modules with features.{role}"
                )


@register_method(
    "reviewkd",
    ReviewKDParams,
    doc="Chen et al. 2021: weight*min(epoch/warmup,1)*sum HCL(ABF-fused student features, teacher features) + CE",
)
class ReviewKD(Term):
    needs_features = True

    def __init__(self, params: ReviewKDParams, shapes):
        super().__init__()
        if not shapes.student or len(shapes.student) != len(shapes.teacher):
            raise KdbenchError("method reviewkd needs the same, non-zero number of teacher and student features")
        _check_maps(shapes)
        self.weight, self.warmup = params.weight, params.warmup
        self._fusion = [ReviewFusion(list(shapes.student), list(shapes.teacher), params.mid_channels)]  # student's

    def adapter(self) -> tuple[slice, nn.Module]:
        # Trainee calls adapter(feats[index]): a slice hands the module the whole list of features.
        return slice(None), self._fusion[0]

    def forward(self, inp: LossInputs) -> torch.Tensor:
        fused: list[torch.Tensor] = inp.adapted["reviewkd"]  # type: ignore[assignment]
        return self.weight * warmup_ramp(inp.epoch, self.warmup) * hcl_loss(fused, inp.teacher_feats)


def warmup_ramp(epoch: int | None, warmup: int) -> float:
    """The term's share of its weight in training epoch ``epoch`` (1-based): min(epoch / warmup, 1), as
    mdistiller's ReviewKD; 1 without a warm-up, and for a timing cell (``epoch`` None: no epochs)."""
    if epoch is None or not warmup:
        return 1.0
    return min(epoch / warmup, 1.0)
