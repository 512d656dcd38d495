"""Skew forward KL for language models (DistiLLM, Ko et al. 2024, ``skewed_forward_kl``):
KL(p_T || λ·p_T + (1 − λ)·p_S) per token, × T²; the true KL (DistiLLM returns the cross-entropy form)."""

from __future__ import annotations

from pydantic import Field

from kdbench.distill.lm.terms import TokenParams, TokenTerm
from kdbench.distill.losses.registry import register_method


class SkewFKLParams(TokenParams):
    """Skew forward KL per token: alpha * T² * SKL_lam + (1 − alpha) * CE."""

    # the teacher's share λ of the skewed mixture (DistiLLM's default 0.1; 0: forward KL)
    lam: float = Field(0.1, ge=0, le=1)


@register_method("skew_fkl", SkewFKLParams, doc="LM: DistiLLM skew forward KL(p_T || lam*p_T+(1-lam)*p_S) per token")
class SkewFKL(TokenTerm):
    divergence = "skew_fkl"
