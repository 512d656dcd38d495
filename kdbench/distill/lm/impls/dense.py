"""``dense``: the reference implementation, written as a careful user writes it: both heads on the valid
tokens' hidden states, then the float32 loss on the two logits, plain autograd.

The valid rows are picked from the hidden states (an (n_valid, H) copy) before the heads, so no head, softmax
or cross-entropy runs on a masked prompt position.  On the logits: the log-softmaxes of both at T, the
divergence's terms on them (:class:`~kdbench.distill.lm.token_losses.Dists`; no drop masks where no logit
can be infinite, i.e. heads without a bias), and at T = 1 the cross-entropy read from the student's
log-softmax (its gather: one log-softmax, one backward through it, where ``F.cross_entropy`` would make and
differentiate a second).  A divergence that gives only its value (a user's) runs it on the valid rows.
Equal to :mod:`kdbench.distill.lm.token_losses`' functions in value and gradient.

:func:`token_loss` is the dense token loss on logits, also what :class:`~kdbench.distill.lm.loss.LMLoss`
computes for a model that returns its logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.lm.divergences import TokenLoss, get_divergence, resolved
from kdbench.distill.lm.impls.base import AlignedHeads, Buffers, Heads, LossImpl, Settings, register_impl
from kdbench.distill.lm.impls.chunks import head_logits, zero
from kdbench.distill.lm.token_losses import Dists, upcast
from kdbench.distill.lm.uld import uld_rows

__all__ = ["cross_entropy", "token_loss"]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, n_valid: int) -> torch.Tensor:
    """The next-token cross-entropy in float32 (of float64 logits: float64), summed over the tokens whose label is
    not -100 and divided by ``n_valid`` (their count, on the host; 0 tokens: 0, not NaN).  ``logits``: (..., V),
    ``labels``: (...)."""
    ce = F.cross_entropy(
        upcast(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return ce / max(n_valid, 1)


def token_loss(
    student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor, loss: TokenLoss, may_inf: bool = True
) -> torch.Tensor:
    """``ce_weight · CE + kd_weight · D`` of the valid tokens' logits, float32, plain autograd.

    ``student``, ``teacher``: (n_valid, V) logits (any float dtype; ``teacher`` None without a divergence),
    ``labels``: (n_valid,), none of them -100.  ``may_inf`` False: no logit is infinite (heads without a bias),
    so no drop mask is made.  Pass the logits without keeping a reference: this function lets go of them once
    their log-softmaxes exist."""
    n = labels.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    if not loss.has_kd:
        return total + loss.ce_weight * cross_entropy(student, labels, n)
    div = get_divergence(loss.divergence)
    # At T = 1 the student's log-softmax is the one cross-entropy takes: CE = −Σ log p_s[label]
    shared = loss.has_ce and loss.temperature == 1.0 and not may_inf and div.terms is not None
    if loss.has_ce and not shared:
        total = total + loss.ce_weight * cross_entropy(student, labels, n)
    if div.terms is None:  # only its value: on the valid rows, no mask
        value = div.value(student, teacher, None, temperature=loss.temperature, **loss.kwargs)
        return total + loss.kd_weight * value
    d = Dists(student, teacher, None, loss.temperature, finite=not may_inf)
    del student, teacher
    if shared:
        total = total - loss.ce_weight / max(n, 1) * d.log_ps.gather(1, labels[:, None]).sum()
    return total + loss.kd_weight * d.reduce(div.terms(d, **loss.kwargs))


def _teacher_logits(heads: Heads, rows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return head_logits(heads.teacher_hidden, heads.teacher_weight, heads.teacher_bias, rows)


def compute(heads: Heads, loss: TokenLoss, rows: torch.Tensor, settings: Settings) -> torch.Tensor:
    h = heads
    total = zero(h.student_hidden, h.student_weight, h.student_bias)  # attached even where D ignores the student
    return total + token_loss(
        head_logits(h.student_hidden, h.student_weight, h.student_bias, rows),
        _teacher_logits(h, rows) if loss.has_kd else None,
        h.labels.index_select(0, rows),
        loss,
        h.may_inf,
    )


def buffers(loss: TokenLoss, n_tokens: int, chunk_size: int, dtype_bytes: int) -> Buffers:
    """Both logits (in their dtype) and the float32 work, all of the valid rows: see :func:`work`."""
    full = ((2 if loss.has_kd else 1, dtype_bytes, "logits"), (work(loss, dtype_bytes), 4, "float32 work"))
    return Buffers(full, (), min(chunk_size, n_tokens))


def work(loss: TokenLoss, dtype_bytes: int) -> float | None:
    """dense's float32 (n_valid, V) buffers at its peak beside its logits, heads without a bias: the
    divergence's ``dense_fp32`` (its work beside two float32 logits at T = 1), + 1 for the cross-entropy's own
    log-softmax at T ≠ 1; CE alone: 2.  With 16-bit logits their float32 upcasts take the logits' place at the
    peak: the count grows by what the logits shrink.  A head with a bias adds the infinite-logit masks and
    their where() copies (1.25 to 2.25 more; none of the registered LMs has one).  None where the divergence
    gives no count."""
    logits = (2 if loss.has_kd else 1) * dtype_bytes / 4
    if not loss.has_kd:
        return 3 - logits
    count = resolved(loss)[0].dense_fp32
    if count is None:
        return None
    return 2 + count + (1 if loss.has_ce and loss.temperature != 1.0 else 0) - logits


def uld(heads: AlignedHeads, settings: Settings) -> torch.Tensor:
    """ULD's term: both heads on the aligned rows (picked by index from each side's hidden states), then
    :func:`~kdbench.distill.lm.uld.uld_rows` on the two logits, weighted by the alignment, plain autograd."""
    h, a = heads, heads.alignment
    s = head_logits(h.student_hidden, h.student_weight, h.student_bias, a.student)
    with torch.no_grad():
        t = head_logits(h.teacher_hidden, h.teacher_weight, h.teacher_bias, a.teacher)
    dist = uld_rows(s, t, h.student_temperature, h.teacher_temperature)
    total = zero(h.student_hidden, h.student_weight, h.student_bias)  # attached even with no aligned row
    return total + (dist * a.weight.to(dist.dtype)).sum()


register_impl(LossImpl("dense", compute, buffers, uld=uld))
