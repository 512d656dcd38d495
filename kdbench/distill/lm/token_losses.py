"""Token-level distillation losses for language models, as pure torch functions.

Every function takes student and teacher logits of shape (B, S, V) or (N, V) and an optional
boolean ``mask`` of the valid tokens, shaped like the logits without their last axis (True =
counted; prompt and padding positions False).  They all share one convention:

* **float32**: the logits are upcast to float32 before anything else, whatever their dtype
  (bf16, fp16), and the loss is a float32 scalar.
* **temperature**: p = softmax(logits / T) for both the student and the teacher, and the loss is
  multiplied by T² (Hinton et al. 2015), so that its gradient keeps its size as T changes.  Every
  function scales by T², including ``generalized_jsd`` (TRL's GKD does not) and the skew KLs
  (DistiLLM has no temperature); at T = 1 nothing changes.
* **reduction**: the divergence is summed over the vocabulary per token and averaged over the
  valid tokens: ``sum_{valid tokens} D(token) / n_valid``.  This is TRL's ``"batchmean"`` with a
  label mask and DistiLLM's / torchtune's normalisation.  With ``mask=None`` every position counts
  (B·S tokens).  A batch with no valid token gives 0 (not NaN), still attached to the graph.
* **infinite logits**: a vocabulary entry whose student or teacher logit is infinite (say -inf
  for padded vocabulary rows) is left out of the sum over the vocabulary, as DistiLLM's
  ``inf_mask`` does; so a -inf student logit under a teacher with mass there adds 0, not inf.

All losses are differentiable with respect to the student logits (the teacher is usually
detached by the caller; gradients flow into it too if it is not).

References (their exact definitions are transcribed in ``tests/test_token_losses.py``):

* TRL ``GKDTrainer.generalized_jsd_loss`` (trl/experimental/gkd/gkd_trainer.py, TRL >= 0.16 beta
  convention, checked at commit f2cd577 / v1.9.0+): beta = 0 forward KL, beta = 1 reverse KL.
* DistiLLM (Ko et al. 2024), distillm/losses.py ``skewed_forward_kl`` / ``skewed_reverse_kl``.
* torchtune ``ForwardKLLoss`` (torchtune/modules/loss/kd_losses.py), DistiLLM's ``forward_kl``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kdbench.errors import KdbenchError

__all__ = [
    "forward_kl",
    "forward_kl_ce_form",
    "generalized_jsd",
    "reverse_kl",
    "skew_forward_kl",
    "skew_reverse_kl",
    "total_variation",
]


class _Dists:
    """Log-probabilities and probabilities of the valid tokens, (n_valid, V) float32, with the
    entries where either logit is infinite set to log p = 0 and p = 0 (left out of every sum)."""

    def __init__(
        self, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None, temperature: float
    ) -> None:
        if student.shape != teacher.shape:
            raise KdbenchError(
                f"student and teacher logits differ in shape: {tuple(student.shape)} vs {tuple(teacher.shape)}"
            )
        if student.dim() < 2:
            raise KdbenchError(f"logits need a vocabulary axis: (B, S, V) or (N, V), got {tuple(student.shape)}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise KdbenchError(f"temperature must be a positive number, got {temperature}")
        vocab = student.shape[-1]
        s = student.float().reshape(-1, vocab)
        t = teacher.float().reshape(-1, vocab)
        if mask is not None:
            if mask.shape != student.shape[:-1]:
                raise KdbenchError(
                    f"mask must have the logits' shape without the vocabulary axis, {tuple(student.shape[:-1])}, "
                    f"got {tuple(mask.shape)}"
                )
            valid = mask.reshape(-1).to(device=s.device, dtype=torch.bool)
            s, t = s[valid], t[valid]  # prompt/padding rows never enter the computation
        self.n_tokens = s.shape[0]
        self.scale = temperature**2
        drop = torch.isinf(s) | torch.isinf(t)
        self.log_ps = torch.where(drop, 0.0, F.log_softmax(s / temperature, dim=-1))
        self.log_pt = torch.where(drop, 0.0, F.log_softmax(t / temperature, dim=-1))
        self.ps = torch.where(drop, 0.0, self.log_ps.exp())
        self.pt = torch.where(drop, 0.0, self.log_pt.exp())

    def reduce(self, per_entry: torch.Tensor) -> torch.Tensor:
        """Sum over the vocabulary and the valid tokens, / n_valid (1 when none), × T²."""
        return per_entry.sum() / max(self.n_tokens, 1) * self.scale


def _log_mixture(log_a: torch.Tensor, log_b: torch.Tensor, w: float) -> torch.Tensor:
    """log(w·a + (1 − w)·b) from log a and log b, in log space (logsumexp)."""
    if w == 0.0:
        return log_b
    if w == 1.0:
        return log_a
    return torch.logsumexp(torch.stack([log_a + math.log(w), log_b + math.log1p(-w)]), dim=0)


def _check_unit(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise KdbenchError(f"{name} must lie in [0, 1], got {value}")
    return float(value)


def forward_kl(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Forward KL(p_T || p_S) = Σ_v p_T (log p_T − log p_S), × T², mean over valid tokens.

    The true KL, with the teacher-entropy term, so it is 0 when student == teacher.  torchtune's
    ``ForwardKLLoss`` and DistiLLM's ``forward_kl`` return the cross-entropy form instead
    (:func:`forward_kl_ce_form`): the same gradient, a value larger by the teacher's entropy.
    """
    d = _Dists(student, teacher, mask, temperature)
    return d.reduce(d.pt * (d.log_pt - d.log_ps))


def forward_kl_ce_form(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Cross-entropy form of the forward KL, −Σ_v p_T log p_S, × T², mean over valid tokens.

    The value of torchtune's ``ForwardKLLoss`` (and DistiLLM's ``forward_kl``): the forward KL
    without the teacher-entropy term, i.e. ``forward_kl + H(p_T)``.  Same gradient w.r.t. the
    student as :func:`forward_kl`, different value (not 0 when student == teacher).
    """
    d = _Dists(student, teacher, mask, temperature)
    return d.reduce(-d.pt * d.log_ps)


def reverse_kl(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Reverse KL(p_S || p_T) = Σ_v p_S (log p_S − log p_T), × T², mean over valid tokens."""
    d = _Dists(student, teacher, mask, temperature)
    return d.reduce(d.ps * (d.log_ps - d.log_pt))


def generalized_jsd(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """TRL GKD's generalised Jensen-Shannon divergence (Agarwal et al. 2024, Eq. 1), × T².

    With m = beta·p_T + (1 − beta)·p_S (its log computed by logsumexp):
    ``beta·KL(p_T || m) + (1 − beta)·KL(p_S || m)``; beta = 0 is the forward KL(p_T || p_S) and
    beta = 1 the reverse KL(p_S || p_T), exactly as TRL special-cases them (the general formula
    tends to 0 at both ends; divided by beta, resp. 1 − beta, it tends to those KLs, so the ends are
    a jump, TRL's convention kept here).  This is TRL's beta
    convention since v0.16 (PR #3043); earlier TRL mixed m = beta·p_S + (1 − beta)·p_T.  TRL does
    not multiply by T²; this function does, like every loss here.  Mean over valid tokens, as
    TRL's ``"batchmean"`` with labels.
    """
    beta = _check_unit("beta", beta)
    d = _Dists(student, teacher, mask, temperature)
    if beta == 0.0:
        return d.reduce(d.pt * (d.log_pt - d.log_ps))
    if beta == 1.0:
        return d.reduce(d.ps * (d.log_ps - d.log_pt))
    log_m = _log_mixture(d.log_pt, d.log_ps, beta)
    return d.reduce(beta * d.pt * (d.log_pt - log_m) + (1.0 - beta) * d.ps * (d.log_ps - log_m))


def total_variation(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Total variation distance 0.5·Σ_v |p_T − p_S|, × T², mean over valid tokens (DistiLLM's
    ``tv_distance`` at T = 1)."""
    d = _Dists(student, teacher, mask, temperature)
    return d.reduce(0.5 * (d.pt - d.ps).abs())


def skew_forward_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor | None = None,
    lam: float = 0.1,
    temperature: float = 1.0,
) -> torch.Tensor:
    """DistiLLM's skew forward KL, SKL = KL(p_T || lam·p_T + (1 − lam)·p_S), × T².

    lam is the teacher's share of the mixture, as in DistiLLM's ``skewed_forward_kl`` (lam = 0:
    forward KL; lam = 1: 0).  DistiLLM returns the cross-entropy form −Σ p_T log m (no teacher
    entropy term); this is the true KL, 0 when student == teacher: same gradient, a value smaller
    by H(p_T).  The mixture's log is computed by logsumexp (DistiLLM: log of the mixed probs).
    """
    lam = _check_unit("lam", lam)
    d = _Dists(student, teacher, mask, temperature)
    log_m = _log_mixture(d.log_pt, d.log_ps, lam)
    return d.reduce(d.pt * (d.log_pt - log_m))


def skew_reverse_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor | None = None,
    lam: float = 0.1,
    temperature: float = 1.0,
) -> torch.Tensor:
    """DistiLLM's skew reverse KL, SRKL = KL(p_S || lam·p_S + (1 − lam)·p_T), × T².

    lam is the student's share of the mixture, as in DistiLLM's ``skewed_reverse_kl`` (lam = 0:
    reverse KL; lam = 1: 0).  Same value as DistiLLM's (a true KL there too) at T = 1.
    """
    lam = _check_unit("lam", lam)
    d = _Dists(student, teacher, mask, temperature)
    log_m = _log_mixture(d.log_ps, d.log_pt, lam)
    return d.reduce(d.ps * (d.log_ps - log_m))
