"""Skew reverse KL for language models (DistiLLM, Ko et al. 2024, ``skewed_reverse_kl``):
KL(p_S || λ·p_S + (1 − λ)·p_T) per token, × T²."""

from __future__ import annotations

from pydantic import Field

from kdbench.distill.lm.terms import TokenParams, TokenTerm
from kdbench.distill.losses.registry import register_method


class SkewRKLParams(TokenParams):
    """Skew reverse KL per token: alpha * T² * SRKL_lam + (1 − alpha) * CE."""

    # the student's share λ of the skewed mixture (DistiLLM's default 0.1; 0: reverse KL)
    lam: float = Field(0.1, ge=0, le=1)


@register_method("skew_rkl", SkewRKLParams, doc="LM: DistiLLM skew reverse KL(p_S || lam*p_S+(1-lam)*p_T) per token")
class SkewRKL(TokenTerm):
    divergence = "skew_rkl"
