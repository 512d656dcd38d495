"""CRD: Tian et al. 2020, "Contrastive Representation Distillation" (ICLR; RepDistiller's ``crd/``,
mdistiller's ``CRD``).

loss = CE + beta * (NCE_s + NCE_t).  Each side's penultimate embedding -- the LAST paired
stage feature, globally average-pooled to (N, C) -- goes through an embedding head
(linear + l2 normalisation) to ``feat_dim``.  A memory bank per side holds one
embedding for each of ``n_data`` training samples.  The student embedding of sample i
is scored against the teacher bank's entry i (the positive) and ``nce_k`` random
entries (negatives), and the teacher embedding against the student bank likewise:
``exp(<v, m> / nce_t) / Z``.  NCE with a uniform noise distribution 1 / n_data turns
the scores into the loss (``ContrastLoss``), and the banks are then updated with
momentum ``nce_mom`` and renormalised (``ContrastMemory``).

Where things live.
  * Both heads are ONE adapter module (:class:`CRDHeads`): ``step.Trainee`` applies it to
    the student's last feature inside the student's forward (the student head), and the
    loss calls its ``teacher`` head on the teacher's (possibly cached) feature every step.
    Being an adapter, both heads are in ``Trainee.parameters()`` -- the optimizer trains them
    with the student -- are placed on the student's device, and count in
    ``Distiller.adapter_params`` (mdistiller's ``get_learnable_parameters`` trains both heads
    too).  ``Term.adapter()`` returns a single module, so the teacher head rides in the
    student's adapter rather than in a second one.  Under DDP it is used outside the wrapped
    forward; its gradients still arrive in the same backward, so the reducer sees them.
  * The banks (and the normalisation constants Z) are registered buffers of the term,
    not of the adapter: DDP would broadcast an adapter's buffers from rank 0 at every
    forward (2 * n_data * feat_dim floats per step), which the reference never does.
    The loss is not moved with the models, so the term moves its buffers to the
    features' device on its first call (a host-side device check, no synchronisation).
    Memory: 2 * n_data * feat_dim * 4 bytes (51.2 MB at the defaults 50000 x 128).

Sample indices.  kdbench feeds no dataset indices: the samples of a batch get the
indices 0..B-1 (B <= n_data).  In a synthetic cell the batch is fixed, so these are
the same samples every step, as in the reference; the bank still holds n_data entries,
so the negatives and the memory cost are those of an n_data-sample dataset.

Negatives.  ``nce_k`` indices drawn uniformly from [0, n_data) with ``torch.randint`` on the
device (the reference's ``ContrastMemory`` draws from uniform unigrams the same way when
given no indices; its CIFAR loader's "exact" mode draws from other classes, which needs
labels of the whole dataset).  Column 0 of the contrast indices is the positive.

Z.  The reference fixes each side's Z from the first batch (``mean(scores) * n_data``) and
reads it back with ``.item()``; here Z is a device tensor (initially -1) set on the
device by ``torch.where`` on the first call and kept afterwards: no host-device sync.

Defaults are mdistiller's CIFAR-100 config (CRD.FEAT.DIM 128, NCE.K 16384, NCE.TEMPERATURE
0.07, NCE.MOMENTUM 0.5, LOSS.FEAT_WEIGHT 0.8, LOSS.CE_WEIGHT 1.0); n_data 50000 is CIFAR's
training set.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import nn

from kdbench.config.base import Strict
from kdbench.core.errors import KdbenchError
from kdbench.distill.losses.fitnet import pooled
from kdbench.distill.losses.registry import LossInputs, Term, register_method

EPS = 1e-7  # ContrastLoss's eps


class CRDParams(Strict):
    """Contrastive Representation Distillation (Tian et al. 2020): CE + beta * (NCE_s + NCE_t)."""

    beta: float = Field(0.8, ge=0, le=1e7)  # weight of the contrastive term (CE keeps weight 1)
    feat_dim: int = Field(128, ge=1, le=65536)  # embedding dimension of both heads
    nce_k: int = Field(16384, ge=1, le=10_000_000)  # negatives per sample
    nce_t: float = Field(0.07, gt=0, le=1000)  # temperature of the scores
    nce_mom: float = Field(0.5, ge=0, le=1)  # momentum of the memory-bank update
    n_data: int = Field(50000, ge=1, le=100_000_000)  # entries of each bank (training samples); batch <= n_data


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """The reference's ``Normalize(2)``: x / ||x||_2 along dim 1 (no eps)."""
    return x.div(x.pow(2).sum(1, keepdim=True).pow(0.5))


class Embed(nn.Module):
    """The reference's ``Embed``: (N, C, ...) pooled to (N, C), linear to feat_dim, l2-normalised (FP32)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2norm(self.linear(pooled(x)).float())


class CRDHeads(nn.Module):
    """The adapter: the student head (its forward) and the teacher head (called by the loss)."""

    def __init__(self, c_student: int, c_teacher: int, feat_dim: int):
        super().__init__()
        self.student = Embed(c_student, feat_dim)
        self.teacher = Embed(c_teacher, feat_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


def init_bank(n_data: int, feat_dim: int) -> torch.Tensor:
    """``ContrastMemory``'s initial bank: uniform in [-stdv, stdv), stdv = 1 / sqrt(feat_dim / 3)."""
    stdv = 1.0 / math.sqrt(feat_dim / 3)
    return torch.rand(n_data, feat_dim).mul_(2 * stdv).add_(-stdv)


def contrast_idx_for(idx: torch.Tensor, n_data: int, k: int) -> torch.Tensor:
    """(B, K+1) bank indices: column 0 the positives ``idx``, then K uniform draws on the device."""
    negatives = torch.randint(0, n_data, (idx.shape[0], k), device=idx.device)
    return torch.cat([idx[:, None], negatives], dim=1)


def scores(v: torch.Tensor, memory: torch.Tensor, contrast_idx: torch.Tensor, T: float) -> torch.Tensor:
    """exp(<memory[contrast_idx[b, j]], v[b]> / T): (B, K+1), the bank detached."""
    b, k1 = contrast_idx.shape
    weight = memory.index_select(0, contrast_idx.reshape(-1)).detach().view(b, k1, memory.shape[1])
    return torch.exp(torch.bmm(weight, v[:, :, None]).squeeze(2) / T)


def nce_loss(x: torch.Tensor, n_data: int) -> torch.Tensor:
    """``ContrastLoss`` on normalised scores x (B, K+1), column 0 the positive; noise Pn = 1 / n_data."""
    m = x.shape[1] - 1
    mpn = m / float(n_data)
    p_pos, p_neg = x[:, 0], x[:, 1:]
    log_d1 = torch.log(p_pos / (p_pos + mpn + EPS))
    log_d0 = torch.log(mpn / (p_neg + mpn + EPS))
    return -(log_d1.sum() + log_d0.sum()) / x.shape[0]


def normaliser(z: torch.Tensor, out: torch.Tensor, n_data: int) -> torch.Tensor:
    """Z: kept when set (>= 0), else mean(out) * n_data of this batch (the reference's first-batch Z), on the device."""
    return torch.where(z < 0, out.detach().mean() * n_data, z)


def crd_loss(
    v_s: torch.Tensor,
    v_t: torch.Tensor,
    mem_s: torch.Tensor,
    mem_t: torch.Tensor,
    contrast_idx: torch.Tensor,
    T: float,
    z_s: torch.Tensor,
    z_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NCE_s + NCE_t of Tian et al. 2020 and the Z values used, (loss, z_s, z_t).

    ``v_s``/``v_t``: l2-normalised embeddings (B, D); ``mem_s``/``mem_t``: the banks (n_data, D);
    ``contrast_idx``: (B, K+1), column 0 the positives.  The student embedding is scored
    against the teacher bank (the reference's ``out_v1``), the teacher embedding against
    the student bank.  ``z_s``/``z_t``: 0-d tensors; a negative one is set from this batch.
    """
    n_data = mem_s.shape[0]
    out_s = scores(v_s, mem_t, contrast_idx, T)
    out_t = scores(v_t, mem_s, contrast_idx, T)
    z_s, z_t = normaliser(z_s, out_s, n_data), normaliser(z_t, out_t, n_data)
    loss = nce_loss(out_s / z_s, n_data) + nce_loss(out_t / z_t, n_data)
    return loss, z_s, z_t


@torch.no_grad()
def momentum_update(memory: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, momentum: float) -> None:
    """``ContrastMemory``'s update in place: memory[idx] = l2norm(momentum * memory[idx] + (1 - momentum) * v)."""
    pos = memory.index_select(0, idx).mul_(momentum).add_(v.detach().to(memory.dtype) * (1 - momentum))
    memory.index_copy_(0, idx, l2norm(pos))


@register_method(
    "crd", CRDParams, doc="Tian et al. 2020: CE + beta*(NCE_s + NCE_t), embedding heads and momentum memory banks"
)
class CRD(Term):
    needs_features = True

    def __init__(self, params: CRDParams, shapes):
        super().__init__()
        if not shapes.student or not shapes.teacher:
            raise KdbenchError("crd: needs one paired feature on each side (features.teacher / features.student)")
        self.index = len(shapes.student) - 1  # the last paired stage: the penultimate embedding, pooled
        self.p = params
        self.beta = params.beta
        self._heads = [CRDHeads(shapes.student[-1][1], shapes.teacher[-1][1], params.feat_dim)]  # owned by the student
        self.register_buffer("memory_s", init_bank(params.n_data, params.feat_dim))
        self.register_buffer("memory_t", init_bank(params.n_data, params.feat_dim))
        self.register_buffer("z", torch.full((2,), -1.0))  # Z of the student and teacher scores; < 0: unset

    def adapter(self) -> tuple[int, nn.Module]:
        return self.index, self._heads[0]

    def forward(self, inp: LossInputs) -> torch.Tensor:
        v_s = inp.adapted["crd"].float()
        if self.memory_s.device != v_s.device:  # first call: the banks join the features' device
            self.to(v_s.device)
        v_t = self._heads[0].teacher(inp.teacher_feats[self.index].float())
        b = v_s.shape[0]
        if b > self.p.n_data:
            raise KdbenchError(f"crd.n_data: {self.p.n_data} bank entries cannot hold a batch of {b}; raise n_data")
        # The batch's samples: their data-set indices when the step has them (quality training), else 0..B-1.
        idx = inp.indices if inp.indices is not None else torch.arange(b, device=v_s.device)
        contrast_idx = contrast_idx_for(idx, self.p.n_data, self.p.nce_k)
        loss, z_s, z_t = crd_loss(
            v_s, v_t, self.memory_s, self.memory_t, contrast_idx, self.p.nce_t, self.z[0], self.z[1]
        )
        with torch.no_grad():
            self.z.copy_(torch.stack([z_s, z_t]))
        momentum_update(self.memory_s, v_s, idx, self.p.nce_mom)
        momentum_update(self.memory_t, v_t, idx, self.p.nce_mom)
        return self.beta * loss
