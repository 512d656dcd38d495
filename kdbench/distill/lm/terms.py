"""What the token-level methods share: their parameters' base and the Term they register.

A token-level method (``forward_kl``, ``reverse_kl``, ``jsd``, ``tvd``, ``skew_fkl``, ``skew_rkl``) names one
registered divergence (:mod:`kdbench.distill.lm.divergences`, under the method's name) between the student's
and the teacher's next-token distributions.  On an LM pair the loss (:class:`kdbench.distill.lm.loss.LMLoss`)
hands it to the cell's ``loss_impl``, which computes the LM heads and the loss together
(:mod:`kdbench.distill.lm.impls`); ``forward`` is the dense definition on logits, for anything that holds
them.

``alpha`` weighs the divergence and ``1 - alpha`` the cross-entropy with the next tokens, as
``kd``'s alpha does (torchtune's ``kd_ratio``; TRL's GKD is alpha = 1).  A divergence's parameters
(``beta``, ``lam``) are the method's parameters of the same name.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field

from kdbench.config.base import Strict
from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.lm.divergences import TokenLoss, get_divergence
from kdbench.distill.losses.registry import LossInputs, Term


class TokenParams(Strict):
    # softening temperature T of both next-token distributions (the divergence is scaled by T²)
    temperature: float = Field(1.0, gt=0, le=1000)
    # weight of the divergence; 1 − alpha weighs the cross-entropy with the next tokens
    alpha: float = Field(0.5, ge=0, le=1)


class TokenTerm(Term):
    """One token-level divergence, over the valid (non-prompt) tokens."""

    domain: ClassVar[str] = "lm"
    divergence: ClassVar[str] = ""  # a registered divergence's name (kdbench.distill.lm.divergences)

    def __init__(self, params: TokenParams, shapes: Any = None):
        super().__init__()
        self.params = params
        self.ce_weight = 1.0 - params.alpha

    def _divergence_params(self) -> dict[str, float]:
        """The divergence's parameters this method's parameters set (the others take their defaults)."""
        declared = get_divergence(self.divergence).params
        return {k: getattr(self.params, k) for k in declared if hasattr(self.params, k)}

    def token_loss(self, weight: float = 1.0, ce_weight: float = 0.0) -> TokenLoss:
        """The :class:`~kdbench.distill.lm.divergences.TokenLoss` a loss implementation computes."""
        p = self.params
        return TokenLoss(
            self.divergence,
            temperature=p.temperature,
            kd_weight=weight * p.alpha,
            ce_weight=ce_weight,
            **self._divergence_params(),
        )

    def forward(self, inp: LossInputs) -> torch.Tensor:
        """alpha × the divergence of the logits in ``inp`` over the tokens whose target is not -100."""
        p = self.params
        mask = inp.targets != IGNORE_INDEX
        value = get_divergence(self.divergence).value
        kwargs = self._divergence_params()
        return p.alpha * value(inp.student_logits, inp.teacher_logits, mask, temperature=p.temperature, **kwargs)
