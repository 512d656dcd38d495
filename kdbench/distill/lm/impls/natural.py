"""``natural``: the dense loss as TRL's GKD trainer and torchtune's KD recipe compute it, the form a user's training
script runs today: both models' logits for every position (the LM heads over all B·S hidden states), the float32
log-softmaxes and the divergence's entries over every position, masked afterwards (the valid rows picked from the
entries, then summed over the vocabulary and averaged over the valid tokens), and ``F.cross_entropy(...,
ignore_index=-100)`` beside it on the whole logits (its own log-softmax), plain autograd.

It exists so that a row can be set beside a user's step of the same work: ``dense`` computes the same value and
gradient with less work and memory, and kdbench would otherwise only show the cheaper form.  Against this form
``dense`` saves (a quarter of the tokens a masked prompt, as in llm-cpu): the heads and every (N, V) float32 buffer
over the masked positions (both heads, both log-softmaxes, the divergence's entries and their gradients run on the
valid rows alone), and at T = 1 the cross-entropy's own log-softmax and its backward (it reads CE from the student's
log-softmax).  Equal to ``dense`` in value and gradient (tests/unit/distill/test_lm_impls.py, against TRL's and
torchtune's code).

Sources read: huggingface/trl f2cd57710ae3 ``trl/experimental/gkd/gkd_trainer.py`` (``compute_loss``: the models'
``.logits``, shifted, then ``generalized_jsd_loss``: log-softmaxes of the whole logits, ``F.kl_div(...,
reduction="none", log_target=True)``, ``jsd[mask]``, the sum over the valid tokens); pytorch/torchtune bd2a0fc7
``recipes/knowledge_distillation_single_device.py`` (``_loss_step``: the models' logits, ``ForwardKLLoss`` of
``torchtune/modules/loss/kd_losses.py`` and the class loss, ``CrossEntropyLoss(ignore_index=-100)``, beside it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.lm.divergences import TokenLoss, get_divergence
from kdbench.distill.lm.impls import dense
from kdbench.distill.lm.impls.base import Buffers, Heads, LossImpl, Settings, register_impl
from kdbench.distill.lm.impls.chunks import cast_head, zero
from kdbench.distill.lm.token_losses import Dists

__all__: list[str] = []


def compute(heads: Heads, loss: TokenLoss, rows: torch.Tensor, settings: Settings) -> torch.Tensor:
    """Both heads on every position, then the loss masked afterwards (see the module docstring)."""
    h = heads
    n = rows.numel()
    total = zero(h.student_hidden, h.student_weight, h.student_bias)  # attached even where D ignores the student
    student = F.linear(h.student_hidden, *cast_head(h.student_hidden, h.student_weight, h.student_bias))
    if loss.has_ce:  # F.cross_entropy on the whole logits, ignore_index: its own log-softmax over every position
        total = total + loss.ce_weight * dense.cross_entropy(student, h.labels, n)
    if not loss.has_kd:
        return total
    with torch.no_grad():
        teacher = F.linear(h.teacher_hidden, *cast_head(h.teacher_hidden, h.teacher_weight, h.teacher_bias))
    div = get_divergence(loss.divergence)
    if div.terms is None:  # only its value: the divergence takes the mask of the valid tokens
        mask = h.labels != IGNORE_INDEX
        return total + loss.kd_weight * div.value(student, teacher, mask, temperature=loss.temperature, **loss.kwargs)
    d = Dists(student, teacher, None, loss.temperature, finite=not h.may_inf)  # every position
    del student, teacher
    # TRL's jsd[mask]: the valid rows of the entries (by index: their count is on the host, no sync), summed
    kept = div.terms(d, **loss.kwargs).index_select(0, rows)
    return total + loss.kd_weight * kept.sum() / max(n, 1) * d.scale


def buffers(loss: TokenLoss, n_tokens: int, chunk_size: int, dtype_bytes: int) -> Buffers:
    """dense's buffers over every position (``valid_only`` False), + 1 float32 buffer for the cross-entropy's own
    log-softmax where dense shares the student's (T = 1; at T ≠ 1 dense counts it already)."""
    full = dense.buffers(loss, n_tokens, chunk_size, dtype_bytes).full
    work = dense.work(loss, dtype_bytes)
    if work is not None and loss.has_ce and loss.has_kd and loss.temperature == 1.0:
        work += 1
    return Buffers((full[0], (work, 4, "float32 work")), (), min(chunk_size, n_tokens))


register_impl(
    LossImpl(
        "natural",
        compute,
        buffers,
        valid_only=False,
        uld_why="it is the dense token loss as TRL and torchtune write it, over one shared vocabulary; ULD's term is "
        "computed by dense on the aligned rows",
    )
)
