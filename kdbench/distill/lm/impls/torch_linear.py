"""``torch_linear``: ``torch.nn.functional.linear_cross_entropy``'s chunked path: CE, and the forward KL
through probability targets (the teacher's probabilities are materialised, n_valid × V).  A divergence runs
under it where it is the forward KL: its record's ``liger_beta`` is 0 at the loss's parameters.

Sources read: torch 2.14 ``F.linear_cross_entropy`` and ``torch.nn.LinearCrossEntropyOptions`` docstrings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.lm.divergences import TokenLoss, liger_beta
from kdbench.distill.lm.impls.base import Buffers, Heads, LossImpl, Settings, register_impl
from kdbench.distill.lm.impls.chunks import cast_head, zero


def compute(heads: Heads, loss: TokenLoss, rows: torch.Tensor, settings: Settings) -> torch.Tensor:
    """CE with class-index targets; forward KL as CE with the teacher's probabilities as targets
    (CE(p_T) = KL(p_T‖p_S) + H(p_T): H(p_T) is computed per chunk without grad and subtracted, so
    the value is the true KL).  The targets must have the input's dtype for the chunked path (else
    torch falls back to the reference path, which materialises the logits): in bf16 they are rounded.
    """
    chunk_size = settings.chunk_size
    hs, ht = heads.student_hidden, heads.teacher_hidden
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size)
    w, b = cast_head(hs, heads.student_weight, heads.student_bias)
    n_valid = rows.numel()
    total = zero(hs, heads.student_weight, heads.student_bias)
    if n_valid == 0:
        return total
    if loss.has_ce:
        ce = F.linear_cross_entropy(
            hs, w, heads.labels, linear_bias=b, reduction="sum", ignore_index=IGNORE_INDEX, options=options
        )
        total = total + loss.ce_weight * ce.float() / n_valid
    if loss.has_kd:
        temp = loss.temperature
        w_t, b_t = cast_head(ht, heads.teacher_weight, heads.teacher_bias)
        targets = torch.empty(n_valid, w.shape[0], dtype=hs.dtype, device=hs.device)
        entropy = torch.zeros((), dtype=torch.float32, device=hs.device)
        with torch.no_grad():
            for start in range(0, n_valid, chunk_size):
                p = F.softmax(F.linear(ht[rows[start : start + chunk_size]], w_t, b_t).float() / temp, -1)
                target = targets[start : start + chunk_size]
                target.copy_(p)
                # −Σ p̃ log p with p̃ the targets as stored (rounded in bf16): CE(p̃) − that = Σ p̃ log(p/q)
                entropy -= torch.special.xlogy(target.float(), p).sum()
        h = hs.index_select(0, rows)
        if temp != 1.0:  # softmax(logits / T): (h / T) Wᵀ + b / T
            h, b = h / temp, (b / temp if b is not None else None)
        soft = F.linear_cross_entropy(h, w, targets, linear_bias=b, reduction="sum", options=options)
        total = total + loss.kd_weight * temp**2 * (soft.float() - entropy) / n_valid
    return total


def unsupported(loss: TokenLoss) -> str | None:
    """None for the forward KL (a divergence whose liger beta is 0 at the loss's parameters)."""
    if liger_beta(loss) == 0.0:
        return None
    return (
        f"torch_linear cannot compute {loss.divergence}: F.linear_cross_entropy is a cross-entropy against fixed "
        "targets, which gives the forward KL (targets = the teacher's probabilities) and no divergence that depends "
        "on the student's probabilities otherwise; use fused_linear"
    )


def unavailable() -> str | None:
    """F.linear_cross_entropy and its chunked path's options in this torch (detected by feature)."""
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return None
    return (
        f"torch_linear needs torch.nn.functional.linear_cross_entropy and its chunked path "
        f"(torch.nn.LinearCrossEntropyOptions), which torch {torch.__version__} does not have: "
        "install a torch that has them"
    )


def buffers(loss: TokenLoss, n_tokens: int, chunk_size: int, dtype_bytes: int) -> Buffers:
    """The teacher's probabilities whole (with a divergence), in the hidden states' dtype; the float32 work per
    chunk."""
    kd, ce = loss.has_kd, loss.has_ce
    full = ((1, dtype_bytes, "teacher probabilities"),) if kd else ()
    work = (4 if kd else 3) + (1 if ce and kd else 0)
    return Buffers(full, ((work, 4, "float32 work"),), min(chunk_size, n_tokens))


NEEDS = "a torch with F.linear_cross_entropy and torch.nn.LinearCrossEntropyOptions"
register_impl(
    LossImpl(
        "torch_linear",
        compute,
        buffers,
        unsupported,
        unavailable,
        needs=NEEDS,
        inf_why="its forward KL is a cross-entropy against the teacher's probabilities, which a -inf student logit "
        "under the teacher's mass makes inf",
        uld_why="F.linear_cross_entropy computes a cross-entropy against one head's logits, not a distance between "
        "two sorted probability vectors",
    )
)
