"""The Universal Logit Distillation loss (ULD; Boizard et al. 2024, "Towards Cross-Tokenizer Distillation: the
Universal Logit Distillation Loss for LLMs", arXiv:2402.12030): distillation between two language models whose
vocabularies differ, with no mapping between their tokens.

The authors' formulation (``DistillationLoss`` in Nicolas-BZRD/llm-recipes, ``models/distillation_model.py``, read
at ab6e798; transcribed in ``tests/unit/distill/test_uld.py``,
which checks this module against it in value and gradient):

1. **Alignment by position after the prompt.**  Each side's answer tokens are the ones its labels count
   (label != -100); the student's i-th answer position is paired with the teacher's i-th, for i below the shorter
   answer's length (per sequence).  kdbench's labels are next-token targets (the label at a position is the
   token its logits predict), so a side's answer rows are simply the positions whose label is counted, in order;
   the authors' unshifted labels and their "index of the last prompt token" give the same rows.
2. **Sorted probabilities.**  p = softmax(logits / T) over each side's own vocabulary (the authors' student and
   teacher temperatures, 1 by default; no T² factor), each vector sorted in descending order, the shorter one
   padded with zeros to the longer's length.
3. **The L1 distance** of the two sorted vectors, summed over the vocabulary, averaged over the sequence's
   aligned positions, then over the sequences.  The padded tail adds the longer vector's tail mass; it is summed
   as such here (no padded copy is made: the same value).

The whole objective is ``ce_weight · CE(student, its own labels) + kd_weight · ULD`` (the authors' defaults:
CE 1, ULD 1.5); this module computes the ULD term, the caller its CE.  Where the authors' code takes the mean
over every sequence and gives NaN for a sequence with no aligned position, this one averages over the sequences
that have one and gives 0 (attached to the graph) when none has.

The work is float32 (or the inputs' dtype if wider, float64 for the accuracy ledger), as every token loss of
kdbench is.  Per aligned row the term depends on that row alone, so it can be computed in chunks of rows
(:func:`uld_rows` on a chunk, weighted by :func:`uld_alignment`'s weights).
"""

from __future__ import annotations

import torch

from kdbench.core.names import IGNORE_INDEX

__all__ = ["Alignment", "uld_alignment", "uld_loss", "uld_rows", "uld_value_grad"]


class Alignment:
    """The aligned rows of a batch: ``student`` and ``teacher`` (n,) flat row indices (into each side's (B·S)
    positions) paired in order, ``weight`` (n,) float64, each row's share of the loss (1 / (aligned positions of
    its sequence × sequences with one)), ``sequence`` (n,) the sequence of each row.

    The weights are float64 and each use casts them to its loss's dtype: a float32 loss gets the float32 weights
    it had (1 / k rounded once to float64 then to float32 is 1 / k rounded to float32), the float64 ULD of the
    accuracy ledger's reference the exact ones (float32 weights left it 5e-8 from the authors' loss, issue 45)."""

    def __init__(self, student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, sequence: torch.Tensor):
        self.student, self.teacher, self.weight, self.sequence = student, teacher, weight, sequence

    def __len__(self) -> int:
        return int(self.student.numel())


def uld_alignment(
    student_labels: torch.Tensor, teacher_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> Alignment:
    """Pair each sequence's i-th counted student position with its i-th counted teacher position, for i below the
    shorter count (labels (B, S_s) and (B, S_t), next-token targets, ``ignore_index`` = not counted)."""
    if student_labels.dim() != 2 or teacher_labels.dim() != 2 or student_labels.shape[0] != teacher_labels.shape[0]:
        raise ValueError(
            f"ULD aligns two (B, S) label tensors of one batch size, got {tuple(student_labels.shape)} and "
            f"{tuple(teacher_labels.shape)}"
        )
    ms, mt = student_labels != ignore_index, teacher_labels != ignore_index
    n = torch.minimum(ms.sum(1), mt.sum(1))  # aligned positions per sequence

    def rows(mask: torch.Tensor) -> torch.Tensor:
        keep = mask & (mask.cumsum(1) - 1 < n[:, None])
        return keep.reshape(-1).nonzero().squeeze(1)

    s_rows, t_rows = rows(ms), rows(mt)
    sequence = torch.div(s_rows, student_labels.shape[1], rounding_mode="floor")
    counted = int((n > 0).sum())
    zero = torch.zeros_like(n, dtype=torch.float64)
    per_seq = torch.where(n > 0, 1.0 / (n.clamp(min=1).double() * max(counted, 1)), zero)
    return Alignment(s_rows, t_rows, per_seq[sequence], sequence)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def uld_rows(
    student: torch.Tensor, teacher: torch.Tensor, student_temperature: float = 1.0, teacher_temperature: float = 1.0
) -> torch.Tensor:
    """Per aligned row, the L1 distance of the two sides' sorted probability vectors: student (n, V_s) and teacher
    (n, V_t) logits of aligned rows → (n,), float32 (or wider).  The teacher is taken as a constant."""
    ps = torch.softmax(student.to(_work_dtype(student)) / student_temperature, dim=-1)
    with torch.no_grad():
        pt = torch.softmax(teacher.detach().to(_work_dtype(teacher)) / teacher_temperature, dim=-1)
        pt = pt.to(ps.dtype).sort(dim=-1, descending=True).values
    ps = ps.sort(dim=-1, descending=True).values
    v = min(ps.shape[-1], pt.shape[-1])
    dist = (ps[:, :v] - pt[:, :v]).abs().sum(-1)
    if ps.shape[-1] > v:  # the teacher's vector padded with zeros: |p - 0| = p
        dist = dist + ps[:, v:].sum(-1)
    elif pt.shape[-1] > v:
        dist = dist + pt[:, v:].sum(-1)
    return dist


def uld_value_grad(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    need_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk of aligned rows: ``Σ weight · uld_rows(student, teacher)`` (float32, detached) and its gradient
    w.r.t. the chunk's student logits (None without ``need_grad``), by autograd on the chunk alone: what the
    chunked loss implementations compute per chunk, holding no chunk's graph past it."""
    with torch.enable_grad():
        s = student.detach().requires_grad_(need_grad)
        dist = uld_rows(s, teacher, student_temperature, teacher_temperature)
        value = (dist * weight.to(dist.dtype)).sum()
        grad = torch.autograd.grad(value, s)[0] if need_grad else None
    return value.detach(), grad


def uld_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_labels: torch.Tensor,
    teacher_labels: torch.Tensor,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The ULD term of a batch: logits (B, S_s, V_s) and (B, S_t, V_t), each side's labels (B, S) next-token
    targets.  A float32 scalar, differentiable w.r.t. the student's logits."""
    align = uld_alignment(student_labels, teacher_labels, ignore_index)
    s = student_logits.reshape(-1, student_logits.shape[-1]).index_select(0, align.student)
    t = teacher_logits.reshape(-1, teacher_logits.shape[-1]).index_select(0, align.teacher)
    dist = uld_rows(s, t, student_temperature, teacher_temperature)
    return (dist * align.weight.to(dist.dtype)).sum()
