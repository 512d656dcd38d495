"""RKD: Park, Kim, Lu & Cho 2019, "Relational Knowledge Distillation" (CVPR; their code
lenscloth/RKD and mdistiller's ``RKD``, whose CIFAR-100 defaults these are).

loss = distance_weight * L_D + angle_weight * L_A + CE, on the penultimate embeddings
e (N, D) of student and teacher:

* L_D = smooth_l1(psi_D(e_s), psi_D(e_t)), psi_D the pairwise Euclidean distances
  ||e_i - e_j|| (squared with ``squared``; the squared distance clamped at ``eps``
  first, the diagonal set to 0) divided by their mean over the non-zero pairs;
* L_A = smooth_l1(psi_A(e_s), psi_A(e_t)), psi_A the cosines <u_ji, u_jk> of the
  angles of every triplet, u_ji = normalise(e_i - e_j) (all N^3 of them, as the
  reference computes it);

both smooth-L1 (Huber, beta = 1) averaged over their elements; the teacher's side is
constant.  The embedding is the LAST paired stage feature of each model, globally
average-pooled to (N, C): for CNNs the pooled feature the classifier sees (mdistiller's
``pooled_feat``); tokens (N, C, L) are averaged over their length.

Cost: O(N^2 D) time and O(N^2) memory for the distances, O(N^3 + N^2 D) time and
O(N^3) memory for the angles, N the batch size: it grows fast with the batch.

No value is read back: the mean over the non-zero distances multiplies a mask in and
divides by the clamped count, instead of indexing with a boolean mask (which would
make the host wait for the device every step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.distill.losses.registry import LossInputs, Term, register_method


class RKDParams(Strict):
    """Relational KD (Park et al. 2019): distance_weight * L_D + angle_weight * L_A + CE."""

    # weight of the distance-wise term L_D
    distance_weight: float = Field(25.0, ge=0, le=1e7)
    # weight of the angle-wise term L_A
    angle_weight: float = Field(50.0, ge=0, le=1e7)
    squared: bool = False  # squared Euclidean distances in L_D
    eps: float = Field(1e-12, gt=0, le=1.0)  # floor of the squared distances before the square root


def embedding(feature: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (N, C) in FP32: the global average over the positions, if any."""
    f = feature.float()
    return f.flatten(2).mean(dim=2) if f.dim() > 2 else f


def pairwise_distances(e: torch.Tensor, squared: bool = False, eps: float = 1e-12) -> torch.Tensor:
    """(N, N) Euclidean distances of the rows of ``e``, diagonal 0 (as mdistiller's ``_pdist``)."""
    sq = e.pow(2).sum(dim=1)
    d = (sq[:, None] + sq[None, :] - 2 * e @ e.t()).clamp(min=eps)
    if not squared:
        d = d.sqrt()
    eye = torch.eye(e.shape[0], dtype=torch.bool, device=e.device)
    return torch.where(eye, torch.zeros((), dtype=d.dtype, device=d.device), d)


def normalised_distances(e: torch.Tensor, squared: bool = False, eps: float = 1e-12) -> torch.Tensor:
    """Pairwise distances divided by their mean over the positive ones, without a boolean index."""
    d = pairwise_distances(e, squared, eps)
    positive = (d > 0).to(d.dtype)
    mean = (d * positive).sum() / positive.sum().clamp(min=1)
    return d / mean


def triplet_angles(e: torch.Tensor) -> torch.Tensor:
    """cos of the angle at e_j of every triplet (i, j, k): (N * N * N,), as mdistiller's angle term."""
    diff = F.normalize(e[None, :, :] - e[:, None, :], p=2, dim=2)  # diff[j, i] = normalise(e_i - e_j)
    return torch.bmm(diff, diff.transpose(1, 2)).reshape(-1)


def rkd_parts(
    student: torch.Tensor, teacher: torch.Tensor, squared: bool = False, eps: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_D, L_A) of Park et al. 2019 between two batches of embeddings (N, D_s) and (N, D_t), in FP32."""
    s, t = student.float().flatten(1), teacher.detach().float().flatten(1)
    loss_d = F.smooth_l1_loss(normalised_distances(s, squared, eps), normalised_distances(t, squared, eps))
    loss_a = F.smooth_l1_loss(triplet_angles(s), triplet_angles(t))
    return loss_d, loss_a


@register_method(
    "rkd",
    RKDParams,
    doc="Park et al. 2019: distance_weight*L_D + angle_weight*L_A on pooled last-stage embeddings + CE",
)
class RKD(Term):
    needs_features = True

    def __init__(self, params: RKDParams, shapes=None):
        super().__init__()
        self.distance_weight, self.angle_weight = params.distance_weight, params.angle_weight
        self.squared, self.eps = params.squared, params.eps

    def forward(self, inp: LossInputs) -> torch.Tensor:
        s, t = embedding(inp.student_feats[-1]), embedding(inp.teacher_feats[-1])
        loss_d, loss_a = rkd_parts(s, t, self.squared, self.eps)
        return self.distance_weight * loss_d + self.angle_weight * loss_a
