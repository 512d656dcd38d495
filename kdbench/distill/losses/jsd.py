"""Generalised Jensen-Shannon divergence for language models (GKD, Agarwal et al. 2024; TRL's
``GKDTrainer.generalized_jsd_loss``): with m = β·p_T + (1 − β)·p_S, β·KL(p_T || m) + (1 − β)·KL(p_S || m) per
token, × T²; β = 0 is the forward KL and β = 1 the reverse KL (TRL's convention since v0.16)."""

from __future__ import annotations

from pydantic import Field

from kdbench.distill.lm.terms import TokenParams, TokenTerm
from kdbench.distill.losses.registry import register_method


class JSDParams(TokenParams):
    """Generalised JSD per token: alpha * T² * JSD_beta + (1 − alpha) * CE."""

    # the teacher's share of the mixture m (0: forward KL, 1: reverse KL; TRL's default 0.5)
    beta: float = Field(0.5, ge=0, le=1)
    # GKD trains on the divergence alone (TRL): alpha 1
    alpha: float = Field(1.0, ge=0, le=1)


@register_method("jsd", JSDParams, doc="LM: GKD's generalised JSD_beta per token (TRL; beta 0/1 = forward/reverse KL)")
class JSD(TokenTerm):
    divergence = "jsd"
