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

**Aligned by bytes** (``uld: {alignment: bytes}``; kdbench's variant, not the authors'): by position, the
student's i-th token and the teacher's i-th stop covering the same text after a few tokens when one tokenizer is
coarser (a BPE student of a byte teacher reads about 1.45 bytes per token), so the sorted target comes from other
text than the student predicts.  :func:`byte_alignment` pairs instead, per sequence, **the counted positions that
have read the same text**: student position i and teacher position j whose inputs so far end at the same byte
offset (so the tokens they predict start at that byte).  That is the rule that closes a group in TRL GOLD's
byte-offset alignment (``GOLDTrainer._align_by_byte_offsets``, huggingface/trl#5885: a group ends where both
sides' token spans end at one byte), one pair per group: GOLD then folds the rest of a group into its first
position's distribution by the chain rule, which gives no normalised vector to sort; kdbench keeps the pair of
first positions, the two distributions conditioned on the same text, the one thing a comparison of sorted
probabilities can rely on.  (Pairing a student token with the teacher's position at its *last* byte would give
the teacher most of the token the student is still to predict.)  A student position whose offset no counted
teacher position has (a teacher token straddles it) is left out of the loss, and counted: :func:`matched_share`.
The weights are the position form's (1 / (pairs of the sequence × sequences with one)), so two identical
tokenizations give the position form exactly.  The offsets come from each side's token byte lengths
(:func:`next_token_offsets`; :func:`kdbench.data.tokenizers.token_lengths`).

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

__all__ = [
    "ALIGNMENTS",
    "Alignment",
    "byte_alignment",
    "first_sequences",
    "matched_share",
    "next_token_offsets",
    "uld_alignment",
    "uld_loss",
    "uld_rows",
    "uld_value_grad",
]

ALIGNMENTS = ("position", "bytes")  # uld.alignment: the authors' form (the default), or by the text read


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


def _weighted(s_rows: torch.Tensor, t_rows: torch.Tensor, sequence: torch.Tensor, batch: int) -> Alignment:
    """The Alignment of paired rows, each weighted 1 / (pairs of its sequence × sequences with a pair)."""
    n = torch.bincount(sequence, minlength=batch)
    counted = int((n > 0).sum())
    zero = torch.zeros_like(n, dtype=torch.float64)
    per_seq = torch.where(n > 0, 1.0 / (n.clamp(min=1).double() * max(counted, 1)), zero)
    return Alignment(s_rows, t_rows, per_seq[sequence], sequence)


OFFSET_BITS = 40  # a row's key: its sequence above this many bits, its byte offset below (texts under 1 TiB)


def byte_alignment(
    student_labels: torch.Tensor,
    teacher_labels: torch.Tensor,
    student_offsets: torch.Tensor,
    teacher_offsets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> Alignment:
    """ULD's rows aligned by bytes (the module's docstring): per sequence, each counted student position paired
    with the counted teacher position of the same byte offset, where ``*_offsets`` (same shapes as the labels,
    (B, S_s) and (B, S_t)) give each position's bytes read so far, i.e. where the token it predicts starts
    (:func:`next_token_offsets`).  Pairs in the student's row order; a student position with no teacher position
    at its offset is unpaired (:func:`matched_share`)."""
    if student_labels.dim() != 2 or teacher_labels.dim() != 2 or student_labels.shape[0] != teacher_labels.shape[0]:
        raise ValueError(
            f"ULD aligns two (B, S) label tensors of one batch size, got {tuple(student_labels.shape)} and "
            f"{tuple(teacher_labels.shape)}"
        )
    if student_offsets.shape != student_labels.shape or teacher_offsets.shape != teacher_labels.shape:
        raise ValueError(
            f"byte offsets {tuple(student_offsets.shape)} and {tuple(teacher_offsets.shape)} must have their labels' "
            f"shapes {tuple(student_labels.shape)} and {tuple(teacher_labels.shape)}"
        )

    def keyed(labels: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = (labels != ignore_index).reshape(-1).nonzero().squeeze(1)
        sequence = torch.div(rows, labels.shape[1], rounding_mode="floor")
        key = (sequence << OFFSET_BITS) + offsets.reshape(-1).index_select(0, rows).to(torch.long)
        return rows, sequence, key

    s_rows, s_seq, s_key = keyed(student_labels, student_offsets)
    t_rows, _, t_key = keyed(teacher_labels, teacher_offsets)
    if not len(t_key) or not len(s_key):
        empty = s_rows[:0]
        return _weighted(empty, t_rows[:0], empty, student_labels.shape[0])
    t_sorted, order = t_key.sort()
    at = torch.searchsorted(t_sorted, s_key).clamp(max=len(t_sorted) - 1)
    hit = t_sorted.index_select(0, at) == s_key
    pairs = hit.nonzero().squeeze(1)
    t_match = t_rows.index_select(0, order.index_select(0, at.index_select(0, pairs)))
    return _weighted(s_rows.index_select(0, pairs), t_match, s_seq.index_select(0, pairs), student_labels.shape[0])


def next_token_offsets(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each position's bytes read so far, (B, S) long: the byte lengths (``lengths``, (V,) per token id) of its
    inputs ``ids`` (B, S) summed up to and including it, i.e. the offset at which the token it predicts starts
    (every sequence's first token at byte 0).  Padding after a sequence's end carries on counting; its labels
    are not counted, so it pairs with nothing."""
    return lengths.to(ids.device).index_select(0, ids.reshape(-1)).view(ids.shape).cumsum(1)


def first_sequences(alignment: Alignment, k: int) -> Alignment:
    """The alignment of a batch's first ``k`` sequences alone (their flat rows are the same in the batch cut to
    them), weighted as an alignment of those ``k``: what the accuracy ledger evaluates."""
    keep = (alignment.sequence < k).nonzero().squeeze(1)
    pick = [t.index_select(0, keep) for t in (alignment.student, alignment.teacher, alignment.sequence)]
    return _weighted(pick[0], pick[1], pick[2], k)


def matched_share(alignment: Alignment, student_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> float:
    """The share of the student's counted positions that the alignment pairs (the rest count in no ULD term)."""
    counted = int((student_labels != ignore_index).sum())
    return len(alignment) / counted if counted else 0.0


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
    alignment: Alignment | None = None,
) -> torch.Tensor:
    """The ULD term of a batch: logits (B, S_s, V_s) and (B, S_t, V_t), each side's labels (B, S) next-token
    targets, on the rows of ``alignment`` (None: by position, :func:`uld_alignment`).  A float32 scalar,
    differentiable w.r.t. the student's logits."""
    align = uld_alignment(student_labels, teacher_labels, ignore_index) if alignment is None else alignment
    s = student_logits.reshape(-1, student_logits.shape[-1]).index_select(0, align.student)
    t = teacher_logits.reshape(-1, teacher_logits.shape[-1]).index_select(0, align.teacher)
    dist = uld_rows(s, t, student_temperature, teacher_temperature)
    return (dist * align.weight.to(dist.dtype)).sum()
