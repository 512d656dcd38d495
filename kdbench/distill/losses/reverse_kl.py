"""Reverse KL for language models: KL(p_S || p_T) per token, × T², mean over the valid tokens (MiniLLM's
mode-seeking objective, Gu et al. 2024; GKD's β = 1)."""

from __future__ import annotations

from kdbench.distill.lm.terms import TokenParams, TokenTerm
from kdbench.distill.losses.registry import register_method


class ReverseKLParams(TokenParams):
    """Reverse KL(student || teacher) per token: alpha * T² * KL + (1 − alpha) * CE."""


@register_method("reverse_kl", ReverseKLParams, doc="LM: alpha*T^2*KL(p_S||p_T) per token + (1-alpha)*CE")
class ReverseKL(TokenTerm):
    divergence = "reverse_kl"
