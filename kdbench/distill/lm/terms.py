"""What the token-level methods share: their parameters' base and the Term they register.

A token-level method (``forward_kl``, ``reverse_kl``, ``jsd``, ``tvd``, ``skew_fkl``,
``skew_rkl``) names one divergence of :mod:`kdbench.distill.lm.token_losses` between the
student's and the teacher's next-token distributions.  On an LM pair the loss
(:class:`kdbench.workloads.lm.LMLoss`) hands it to the cell's ``loss_impl``, which computes the
LM heads and the loss together (:mod:`kdbench.distill.lm.impls`); ``forward`` is the dense
definition on logits, for anything that holds them.

``alpha`` weighs the divergence and ``1 - alpha`` the cross-entropy with the next tokens, as
``kd``'s alpha does (torchtune's ``kd_ratio``; TRL's GKD is alpha = 1).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.distill.losses.registry import LossInputs, Term


class TokenParams(Strict):
    # softening temperature T of both next-token distributions (the divergence is scaled by T²)
    temperature: float = Field(1.0, gt=0, le=1000)
    # weight of the divergence; 1 − alpha weighs the cross-entropy with the next tokens
    alpha: float = Field(0.5, ge=0, le=1)


class TokenTerm(Term):
    """One token-level divergence, over the valid (non-prompt) tokens."""

    domain: ClassVar[str] = "lm"
    divergence: ClassVar[str] = ""  # a key of kdbench.distill.lm.impls.DIVERGENCES

    def __init__(self, params: TokenParams, shapes: Any = None):
        super().__init__()
        self.params = params
        self.ce_weight = 1.0 - params.alpha

    def token_loss(self, weight: float = 1.0, ce_weight: float = 0.0):
        """The :class:`~kdbench.distill.lm.impls.TokenLoss` a loss implementation computes."""
        from kdbench.distill.lm.impls import TokenLoss

        p = self.params
        return TokenLoss(
            divergence=self.divergence,
            temperature=p.temperature,
            beta=getattr(p, "beta", 0.5),
            lam=getattr(p, "lam", 0.1),
            kd_weight=weight * p.alpha,
            ce_weight=ce_weight,
        )

    def forward(self, inp: LossInputs) -> torch.Tensor:
        """alpha × the divergence of the logits in ``inp`` over the tokens whose target is not -100."""
        from kdbench.distill.lm.impls import DIVERGENCES

        p = self.params
        mask = inp.targets != -100
        kwargs = {k: getattr(p, k) for k in ("beta", "lam") if hasattr(p, k)}
        fn = DIVERGENCES[self.divergence]
        return p.alpha * fn(inp.student_logits, inp.teacher_logits, mask, temperature=p.temperature, **kwargs)
