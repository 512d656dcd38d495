"""``fused_linear``: heads and loss fused, per chunk of valid tokens (Liger-Kernel's design, in pure torch).

Per chunk: the chunk's logits (model dtype), its float32 loss and gradient g w.r.t. its student logits
(:func:`~kdbench.distill.lm.impls.chunks.chunk_value_grad`), then the gradients w.r.t. h_s, W_s and b_s,
all in the forward; no N × V tensor exists.  Every divergence: by its hand-written ``chunk_grad``, or by
autograd on each chunk for one that gives only its value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdbench.distill.lm.divergences import TokenLoss
from kdbench.distill.lm.impls.base import AlignedHeads, Buffers, Heads, LossImpl, Settings, register_impl
from kdbench.distill.lm.impls.chunked import chunk_work
from kdbench.distill.lm.impls.chunked import unsupported as every_divergence
from kdbench.distill.lm.impls.chunks import cast_head, chunk_total, chunk_value_grad, consume
from kdbench.distill.lm.uld import uld_value_grad


class _HeadGrads:
    """The student's gradients a fused forward builds chunk by chunk: grad_h = g W per chunk's rows, grad_W += gᵀ h
    (a float32 accumulator), grad_b += Σ g; each only where ``needs`` (h, W, b) asks for it."""

    def __init__(self, hs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None, needs) -> None:
        self.need_h, self.need_w, self.need_b = needs
        f32 = torch.float32
        self.h = torch.zeros_like(hs) if self.need_h else None
        self.w = torch.zeros(ws.shape, dtype=f32, device=ws.device) if self.need_w else None
        self.b = torch.zeros(bs.shape, dtype=f32, device=bs.device) if self.need_b else None
        self.dtype, self.w_dtype, self.b_dtype = hs.dtype, ws.dtype, None if bs is None else bs.dtype

    @property
    def any(self) -> bool:
        return self.need_h or self.need_w or self.need_b

    def add(self, g: torch.Tensor, idx: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """One chunk's gradient ``g`` w.r.t. its student logits (rows ``idx`` of the hidden states, ``h`` = those)."""
        g = g.float()
        if self.need_b:
            self.b.add_(g.sum(0))
        g = g.to(self.dtype)  # the gradient w.r.t. the model-dtype logits, as autograd's cast back would give
        if self.need_h:  # .to: autocast may run the mm lower; a chunk's rows are distinct
            self.h.index_copy_(0, idx, (g @ w).to(self.h.dtype))
        if self.need_w:
            if g.dtype == torch.float32:
                self.w.addmm_(g.t(), h)
            else:
                self.w.add_(g.t() @ h)

    def done(self) -> list:
        """grad_h, grad_W, grad_b in their parameters' dtypes (None where not asked for)."""
        return [
            self.h,
            self.w.to(self.w_dtype) if self.need_w else None,
            self.b.to(self.b_dtype) if self.need_b else None,
        ]


class FusedLinearLoss(torch.autograd.Function):
    """loss(h_s, W_s, b_s, h_t, W_t, b_t); per chunk of valid tokens: the chunk's logits (model dtype),
    its float32 loss and gradient g w.r.t. its student logits, then grad_h = g W, grad_W += gᵀ h (float32
    accumulator), grad_b += Σ g.  Backward scales them in place."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, labels, loss: TokenLoss, chunk_size: int, grad_enabled: bool, rows):
        w, b = cast_head(hs, ws, bs)
        w_t, b_t = cast_head(ht, wt, bt)
        grads = _HeadGrads(hs, ws, bs, [grad_enabled and need for need in ctx.needs_input_grad[:3]])
        n_valid = rows.numel()

        def step(start: int, end: int) -> torch.Tensor:
            idx = rows[start:end]
            h = hs.index_select(0, idx)
            part, g = chunk_value_grad(
                F.linear(h, w, b).float(),
                F.linear(ht.index_select(0, idx), w_t, b_t) if loss.has_kd else None,
                labels.index_select(0, idx),
                loss,
                n_valid,
                grads.any,
                bs is not None or bt is not None,  # only an infinite bias makes a logit infinite
            )
            if g is not None:
                grads.add(g, idx, h, w)
            return part

        total = chunk_total(n_valid, chunk_size, hs.device, step)
        ctx.grads = grads.done()
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return (*consume(ctx, grad_output), None, None, None, None, None, None, None, None)


class FusedLinearULD(torch.autograd.Function):
    """ULD's term of (h_s, W_s, b_s, h_t, W_t, b_t) over the aligned rows; per chunk of rows: both chunks' logits,
    ULD's value and gradient g w.r.t. the student chunk's logits (:func:`~kdbench.distill.lm.uld.uld_value_grad`),
    then grad_h, grad_W, grad_b as :class:`FusedLinearLoss` makes them.  Backward scales them in place."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, align, temperatures, chunk_size: int, grad_enabled: bool):
        w, b = cast_head(hs, ws, bs)
        w_t, b_t = cast_head(ht, wt, bt)
        grads = _HeadGrads(hs, ws, bs, [grad_enabled and need for need in ctx.needs_input_grad[:3]])

        def step(start: int, end: int) -> torch.Tensor:
            idx = align.student[start:end]
            h = hs.index_select(0, idx)
            t = F.linear(ht.index_select(0, align.teacher[start:end]), w_t, b_t)
            part, g = uld_value_grad(F.linear(h, w, b), t, align.weight[start:end], *temperatures, need_grad=grads.any)
            if g is not None:
                grads.add(g, idx, h, w)
            return part

        total = chunk_total(align.student.numel(), chunk_size, hs.device, step)
        ctx.grads = grads.done()
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return (*consume(ctx, grad_output), None, None, None, None, None, None, None)


def uld(heads: AlignedHeads, settings: Settings) -> torch.Tensor:
    """ULD's term, heads and loss fused per chunk of aligned rows: no N × V tensor."""
    h = heads
    temperatures = (h.student_temperature, h.teacher_temperature)
    return FusedLinearULD.apply(*h.tensors(), h.alignment, temperatures, settings.chunk_size, torch.is_grad_enabled())


def compute(heads: Heads, loss: TokenLoss, rows: torch.Tensor, settings: Settings) -> torch.Tensor:
    h = heads
    return FusedLinearLoss.apply(*h.tensors(), h.labels, loss, settings.chunk_size, torch.is_grad_enabled(), rows)


def buffers(loss: TokenLoss, n_tokens: int, chunk_size: int, dtype_bytes: int) -> Buffers:
    """No N × V buffer; the float32 work per chunk, and with 16-bit logits the chunk's logits and their
    gradient in their dtype."""
    chunk = [(chunk_work(loss), 4, "float32 work")]
    if dtype_bytes < 4:
        chunk.append((3, dtype_bytes, "logits"))
    return Buffers((), tuple(chunk), min(chunk_size, n_tokens))


register_impl(LossImpl("fused_linear", compute, buffers, every_divergence, uld=uld))
