"""An encoder cell's whole loss: the methods' terms (``minilm``, ``hidden_mse``), weighted, summed in float32
with autocast off; no cross-entropy (task-agnostic distillation: there are no labels)."""

from __future__ import annotations

from typing import Any

import torch

from kdbench.distill.losses import WeightedTerms
from kdbench.models.encoders import Encoder

__all__ = ["EncoderLoss"]


class EncoderLoss(WeightedTerms):
    """Σ_m weights[m] × term_m in float32 with autocast off; no cross-entropy (task-agnostic: no labels)."""

    def __init__(self, config: Any, shapes: Any, teacher: Encoder, student: Encoder):
        super().__init__(config, shapes)
        for term in self.terms:
            if hasattr(term, "set_heads"):  # minilm: the models' own heads (MiniLM v1) unless relation heads are set
                term.set_heads(teacher.heads, student.heads)

    def notes(self, x: torch.Tensor) -> list[str]:
        """What the minilm term computes, with its relations' size."""
        out = []
        for term in self.terms:
            heads = getattr(term, "heads", None)
            if heads is None:
                continue
            b, s = x.shape[:2]
            how = f"relation heads {heads[0]} (MiniLMv2)" if term.relation_heads else f"the models' {heads[0]} heads"
            each = b * heads[0] * s * s * 4
            out.append(
                f"minilm: {len(term.relations)} relation(s) over {how}, each {b}×{heads[0]}×{s}×{s} float32 "
                f"({each / 2**20:.3g} MiB) per model"
            )
        return out

    def forward(self, inp: Any) -> torch.Tensor:
        with torch.amp.autocast(device_type=inp.targets.device.type, enabled=False):
            loss = torch.zeros((), device=inp.targets.device)
            for weight, term in zip(self.weights, self.terms):
                loss = loss + weight * term(inp)
        return loss
