"""Forward KL for language models: KL(p_T || p_S) per token at temperature T, × T², mean over the valid tokens
(Hinton's KD per next token; the loss of torchtune's KD recipe and DistiLLM's ``forward_kl``, which report the
cross-entropy form −Σ p_T log p_S: the same gradient, a value larger by the teacher's entropy H(p_T))."""

from __future__ import annotations

from kdbench.distill.lm.terms import TokenParams, TokenTerm
from kdbench.distill.losses.registry import register_method


class ForwardKLParams(TokenParams):
    """Forward KL(teacher || student) per token: alpha * T² * KL + (1 − alpha) * CE."""


@register_method("forward_kl", ForwardKLParams, doc="LM: alpha*T^2*KL(p_T||p_S) per token + (1-alpha)*CE")
class ForwardKL(TokenTerm):
    divergence = "forward_kl"
