"""``chunked``: the logits of the valid tokens whole (as the model's head makes them), the float32 work per chunk.

The valid rows are picked from the hidden states before the heads (as ``dense`` does: no head runs on a masked
prompt position).  One autograd.Function walks those logits in chunks
(:func:`~kdbench.distill.lm.impls.chunks.chunk_value_grad`) and writes each chunk's gradient into one buffer
shaped like the student logits, in their dtype: the n_valid × V tensors are the two logits and that buffer,
never a float32 upcast of 16-bit logits (torchtune's
``ForwardKLWithChunkedOutputLoss`` upcasts per chunk too, but keeps every chunk's autograd graph until
backward).  Every divergence: by its hand-written ``chunk_grad`` (7 float32 chunk buffers at the peak for
forward KL + CE instead of 13), or by autograd on each chunk for one that gives only its value.
"""

from __future__ import annotations

import torch

from kdbench.distill.lm.divergences import TokenLoss, get_divergence, resolved
from kdbench.distill.lm.impls.base import AlignedHeads, Buffers, Heads, LossImpl, Settings, register_impl
from kdbench.distill.lm.impls.chunks import chunk_total, chunk_value_grad, consume, head_logits, zero
from kdbench.distill.lm.uld import uld_value_grad


class ChunkedLogitsLoss(torch.autograd.Function):
    """loss(student logits, teacher logits) of the valid tokens (n_valid, V); the gradient w.r.t. the student
    logits is computed in forward, chunk by chunk, into one zero-filled buffer in the logits' dtype; backward
    scales it in place (so a second backward through the graph raises)."""

    @staticmethod
    def forward(ctx, logits_s, logits_t, labels, loss: TokenLoss, chunk_size: int, grad_enabled: bool, may_inf):
        n_valid = logits_s.shape[0]
        grad = torch.zeros_like(logits_s) if grad_enabled and ctx.needs_input_grad[0] else None

        def step(start: int, end: int) -> torch.Tensor:
            part, g = chunk_value_grad(  # copies of the chunk: chunk_value_grad overwrites what it is given
                logits_s[start:end].to(torch.float32, copy=True),
                logits_t[start:end].clone() if loss.has_kd else None,
                labels[start:end],
                loss,
                n_valid,
                grad is not None,
                may_inf,
            )
            if g is not None:
                grad[start:end].copy_(g)
            return part

        total = chunk_total(n_valid, chunk_size, logits_s.device, step)
        ctx.grads = [grad]
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return (*consume(ctx, grad_output), None, None, None, None, None, None)


def compute(heads: Heads, loss: TokenLoss, rows: torch.Tensor, settings: Settings) -> torch.Tensor:
    h = heads
    logits_s = head_logits(h.student_hidden, h.student_weight, h.student_bias, rows)
    with torch.no_grad():
        if loss.has_kd:
            logits_t = head_logits(h.teacher_hidden, h.teacher_weight, h.teacher_bias, rows)
        else:
            logits_t = logits_s.new_empty(logits_s.shape[0], 0)
    total = zero(h.student_hidden, h.student_weight, h.student_bias)  # attached even with no valid token
    # forward runs with grad mode off: whether a gradient is wanted at all is decided here
    return total + ChunkedLogitsLoss.apply(
        logits_s,
        logits_t,
        h.labels.index_select(0, rows),
        loss,
        settings.chunk_size,
        torch.is_grad_enabled(),
        h.may_inf,
    )


class ChunkedULD(torch.autograd.Function):
    """ULD's term of the aligned rows' logits (n_aligned, V_s) and (n_aligned, V_t): per chunk of rows, its value
    and its gradient w.r.t. the chunk's student logits (:func:`~kdbench.distill.lm.uld.uld_value_grad`), written
    into one buffer shaped like the student logits; backward scales it in place."""

    @staticmethod
    def forward(ctx, logits_s, logits_t, weight, temperatures, chunk_size: int, grad_enabled: bool):
        grad = torch.zeros_like(logits_s) if grad_enabled and ctx.needs_input_grad[0] else None

        def step(start: int, end: int) -> torch.Tensor:
            part, g = uld_value_grad(
                logits_s[start:end], logits_t[start:end], weight[start:end], *temperatures, need_grad=grad is not None
            )
            if g is not None:
                grad[start:end].copy_(g)
            return part

        total = chunk_total(logits_s.shape[0], chunk_size, logits_s.device, step)
        ctx.grads = [grad]
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return (*consume(ctx, grad_output), None, None, None, None, None)


def uld(heads: AlignedHeads, settings: Settings) -> torch.Tensor:
    """ULD's term: both heads on the aligned rows whole, the float32 sort-and-L1 work per chunk of rows."""
    h, a = heads, heads.alignment
    logits_s = head_logits(h.student_hidden, h.student_weight, h.student_bias, a.student)
    with torch.no_grad():
        logits_t = head_logits(h.teacher_hidden, h.teacher_weight, h.teacher_bias, a.teacher)
    total = zero(h.student_hidden, h.student_weight, h.student_bias)
    temperatures = (h.student_temperature, h.teacher_temperature)
    return total + ChunkedULD.apply(
        logits_s, logits_t, a.weight, temperatures, settings.chunk_size, torch.is_grad_enabled()
    )


def chunk_work(loss: TokenLoss) -> float | None:
    """The float32 (chunk, V) buffers of :func:`chunk_value_grad` at its peak (fused_linear's too): the
    divergence's count (2 without one), + 1 with CE.  None where the divergence gives no count."""
    count = resolved(loss)[0].chunk_fp32 if loss.has_kd else 2
    return None if count is None else count + (1 if loss.has_ce else 0)


def buffers(loss: TokenLoss, n_tokens: int, chunk_size: int, dtype_bytes: int) -> Buffers:
    """The two logits of the valid tokens and their gradient whole, in their dtype; the float32 work per chunk
    (and with 16-bit logits the chunk's float32 upcast is counted in it, the chunk's own logits apart)."""
    full = ((3 if loss.has_kd else 2, dtype_bytes, "logits, their gradient"),)
    chunk = [(chunk_work(loss), 4, "float32 work")]
    if dtype_bytes < 4:
        chunk.append((1, dtype_bytes, "logits"))
    return Buffers(full, tuple(chunk), min(chunk_size, n_tokens))


def unsupported(loss: TokenLoss) -> str | None:
    """None: every registered divergence runs (by autograd on each chunk where it has no ``chunk_grad``)."""
    get_divergence(loss.divergence)
    return None


register_impl(LossImpl("chunked", compute, buffers, unsupported, uld=uld))
