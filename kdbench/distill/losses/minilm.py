"""MiniLM: Wang et al. 2020, "MiniLM: Deep Self-Attention Distillation for Task-Agnostic Compression of
Pre-Trained Transformers" (NeurIPS), with the relation heads of MiniLMv2 (Wang et al. 2021, "MiniLMv2: Multi-Head
Self-Attention Relation Distillation for Compressing Pretrained Transformers", Findings of ACL).

On one teacher layer (``teacher_layer``, by default the last, as v1) and one student layer (``student_layer``, the
last), the student mimics the teacher's self-attention relations:

    L = Σ_{XY in relations} 1/|seqs| Σ_b 1/(R · n_b) Σ_r Σ_{t valid} KL(Rel_T[b, r, t] ‖ Rel_S[b, r, t])
    Rel[b, r, t] = softmax_j( X_r[b, t] · Y_r[b, j] / √d_r )   over the valid keys j

where X, Y are the layer's queries, keys or values (the outputs of its ``query`` / ``key`` / ``value``
projections, all heads concatenated), split into R heads of d_r = width / R, n_b the valid tokens of sequence b,
and the mean taken per sequence, then over the sequences (the paper's per-sequence normalisation).  The default
``relations: [qk, vv]`` is MiniLM v1's L_AT + L_VR: the attention distributions softmax(QKᵀ/√d_k) and the value
relations softmax(VVᵀ/√d_k); MiniLMv2's own loss is ``[qq, kk, vv]``.

Heads.  ``relation_heads: null`` matches the models' own attention heads one to one, which MiniLM v1 requires
(teacher and student with the same head count; d_r is each model's head size).  A number R applies MiniLMv2's
matching: each model's concatenated Q / K / V is split into R relation heads (d_r = width / R, which must divide
both widths), so any pair of head counts works.  With R equal to both models' head count the two are the same.

Q, K and V come from forward hooks on the projections (:class:`kdbench.distill.hooks.FeatureTap`), so the models'
own attention keeps running SDPA; the relations are recomputed here in float32.  Padding keys are left out of each
softmax and padding queries out of the mean (the mask is ``targets != -100``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator

from kdbench.config.base import Strict
from kdbench.core.errors import KdbenchError
from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.losses.registry import LossInputs, Term, register_method

Relation = Literal["qk", "vv", "qq", "kk", "kq", "qv", "vq", "kv", "vk"]
PROJECTIONS = ("query", "key", "value")  # the order the term's features come in
_INDEX = {"q": 0, "k": 1, "v": 2}


class MiniLMParams(Strict):
    """MiniLM (Wang et al. 2020): KL of the teacher's and the student's self-attention relations on one layer."""

    # the teacher layer whose self-attention is distilled (index into its encoder layers; -1: the last, MiniLM v1)
    teacher_layer: int = Field(-1, ge=-1024, le=1023)
    # the student layer that mimics it (-1: the last)
    student_layer: int = Field(-1, ge=-1024, le=1023)
    # relations, each softmax(X Yᵀ/√d) of queries (q), keys (k) or values (v): [qk, vv] is MiniLM v1 (attention
    # distributions and value relations), [qq, kk, vv] MiniLMv2; their KLs are summed
    relations: list[Relation] = Field(default_factory=lambda: ["qk", "vv"], min_length=1, max_length=9)
    # MiniLMv2's relation heads: each model's Q/K/V (heads concatenated) split into this many; null: the models' own
    # heads, which must then be as many in both (MiniLM v1)
    relation_heads: int | None = Field(None, ge=1, le=4096)

    @field_validator("relations")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("each relation at most once")
        return v


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, W) -> (B, heads, S, W / heads) in float32: the concatenated heads split again (MiniLMv2)."""
    b, s, w = x.shape
    return x.float().reshape(b, s, heads, w // heads).transpose(1, 2)


def relation_logits(x: torch.Tensor, y: torch.Tensor, heads: int) -> torch.Tensor:
    """X_r Y_rᵀ / √d_r per relation head: (B, S, W) twice -> (B, heads, S, S), float32."""
    xs, ys = split_heads(x, heads), split_heads(y, heads)
    return xs @ ys.transpose(-1, -2) / math.sqrt(xs.shape[-1])


def relation_kl(teacher: torch.Tensor, student: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) ‖ softmax(student)) over the valid keys, for each head and valid query, averaged per
    sequence over heads and valid queries, then over the sequences that have a valid token.

    ``teacher``, ``student``: (B, R, S, S) relation logits; ``mask``: (B, S), True where a token is attended."""
    keys = mask[:, None, None, :]
    low = torch.finfo(torch.float32).min  # exp() of it minus the row's log-sum-exp is exactly 0
    log_t = torch.log_softmax(teacher.float().masked_fill(~keys, low), dim=-1)
    log_s = torch.log_softmax(student.float().masked_fill(~keys, low), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # (B, R, S): masked keys add 0 (their teacher probability is 0)
    valid = mask.to(kl.dtype)
    n = valid.sum(-1)  # (B,)
    per_seq = (kl * valid[:, None, :]).sum((1, 2)) / (kl.shape[1] * n).clamp_min(1.0)
    return per_seq.sum() / (n > 0).sum().clamp_min(1)


@register_method(
    "minilm",
    MiniLMParams,
    doc="Encoders: KL of the self-attention relations (attention distributions, value relations) on one layer",
)
class MiniLM(Term):
    """The features are the teacher's and the student's query, key and value projections of the chosen layers
    (canonical (N, W, S)), in :data:`PROJECTIONS` order; the workload tells the term the models' head counts
    (:meth:`set_heads`)."""

    needs_features: ClassVar[bool] = True
    domain: ClassVar[str] = "encoder"
    ce_weight: float = 0.0  # task-agnostic: no labels

    def __init__(self, params: MiniLMParams, shapes: Any):
        super().__init__()
        self.relations = [(_INDEX[r[0]], _INDEX[r[1]]) for r in params.relations]
        self.relation_heads = params.relation_heads
        self.heads: tuple[int, int] | None = None  # (teacher, student) relation heads
        if shapes is not None:
            for role in ("teacher", "student"):
                got = getattr(shapes, role)
                if len(got) != 3 or any(len(s) != 3 for s in got):
                    raise KdbenchError(
                        f"minilm compares the query, key and value projections (N, width, S) of one layer; the "
                        f"{role}'s features are {[tuple(s) for s in got]}"
                    )
            self.widths = (int(shapes.teacher[0][1]), int(shapes.student[0][1]))
            if self.relation_heads is not None:
                self.set_heads(self.relation_heads, self.relation_heads)

    def set_heads(self, teacher: int, student: int) -> None:
        """The models' own attention heads (used when relation_heads is null, as MiniLM v1), checked."""
        if self.relation_heads is not None:
            teacher = student = self.relation_heads
        problem = heads_problem(teacher, student, *self.widths, self.relation_heads)
        if problem:
            raise KdbenchError(problem)
        self.heads = (teacher, student)

    def forward(self, inp: LossInputs) -> torch.Tensor:
        if self.heads is None:
            raise KdbenchError("minilm: the models' head counts were not given (set minilm.relation_heads)")
        mask = inp.targets != IGNORE_INDEX
        t = [f.transpose(1, 2) for f in inp.teacher_feats]  # canonical (N, W, S) -> (N, S, W)
        s = [f.transpose(1, 2) for f in inp.student_feats]
        rt, rs = self.heads
        total = torch.zeros((), device=mask.device)
        for i, j in self.relations:
            with torch.no_grad():
                teacher = relation_logits(t[i].detach(), t[j].detach(), rt)
            total = total + relation_kl(teacher, relation_logits(s[i], s[j], rs), mask)
        return total


def heads_problem(teacher: int, student: int, t_width: int, s_width: int, relation_heads: int | None) -> str:
    """Why the two models' Q/K/V cannot be matched head to head ("" when they can)."""
    if relation_heads is None:
        if teacher != student:
            return (
                f"minilm: the teacher has {teacher} attention heads and the student {student}; MiniLM v1 matches "
                "heads one to one: set minilm.relation_heads (MiniLMv2's relation heads, a number dividing both "
                f"widths {t_width} and {s_width}, e.g. {_suggest(teacher, student, t_width, s_width)})"
            )
        return ""
    bad = [f"{role} width {w}" for role, w in (("teacher", t_width), ("student", s_width)) if w % relation_heads]
    if bad:
        return (
            f"minilm.relation_heads {relation_heads} does not divide the {' and the '.join(bad)}; use a divisor of "
            f"both (e.g. {_suggest(teacher, student, t_width, s_width)})"
        )
    return ""


def _suggest(teacher: int, student: int, t_width: int, s_width: int) -> int:
    """A relation head count to suggest: the larger head count, else the smaller, where it divides both widths;
    else the largest usual count that does."""
    g = math.gcd(t_width, s_width)
    return next(
        d for d in (max(teacher, student), min(teacher, student), 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1) if g % d == 0
    )
