"""Total variation distance for language models: 0.5·Σ_v |p_T − p_S| per token, × T² (DistiLLM's ``tv_distance``;
Wen et al. 2023, "f-Divergence Minimization for Sequence-Level KD")."""

from __future__ import annotations

from kdbench.distill.lm.terms import TokenParams, TokenTerm
from kdbench.distill.losses.registry import register_method


class TVDParams(TokenParams):
    """Total variation per token: alpha * T² * TV + (1 − alpha) * CE."""


@register_method("tvd", TVDParams, doc="LM: total variation 0.5*sum|p_T - p_S| per token (DistiLLM's tv_distance)")
class TVD(TokenTerm):
    divergence = "tvd"
