"""Speculative decoding's expected figures, torch-free: what the store derives beside a measured row and what the
measuring code (:mod:`kdbench.models.generation`) and the docs state.

With α the probability that the target accepts a draft token (for sampled verification E[α] = 1 − TV(p, q),
Leviathan et al. 2023, Corollary 3.6), γ the draft tokens proposed per round and c the time of a draft forward
over a target forward:

* tokens per verify step: (1 − α^(γ+1)) / (1 − α) (Leviathan et al. 2023, eq. 1), γ + 1 at α = 1;
* the wall-time speed-up over the target alone: (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (Theorem 3.8).
"""

from __future__ import annotations


def expected_tokens_per_verify(alpha: float, draft_tokens: int) -> float:
    """(1 - α^(γ+1)) / (1 - α): the tokens a verify step yields on average when each proposal is accepted with
    probability α independently (Leviathan et al. 2023, eq. 1); γ + 1 at α = 1."""
    if alpha >= 1:
        return draft_tokens + 1.0
    return (1 - alpha ** (draft_tokens + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, draft_tokens: int, cost_ratio: float) -> float:
    """The expected wall-time speed-up of speculative decoding over the target alone (Leviathan et al. 2023,
    Theorem 3.8): (1 - α^(γ+1)) / ((1 - α)(γc + 1)), with c the time of a draft forward over a target forward
    (a verify step costed as one target forward)."""
    return expected_tokens_per_verify(alpha, draft_tokens) / (draft_tokens * cost_ratio + 1)
