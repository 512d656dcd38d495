"""The chunk machinery ``chunked`` and ``fused_linear`` share (Liger-Kernel's
``LigerFusedLinearDistillationBase`` plays this part there): the valid rows, a chunk's value and gradient,
and gradients computed in forward and handed to backward once.

Each implementation walks the valid tokens in chunks of ``chunk_size`` rows inside one autograd.Function
and calls :func:`chunk_value_grad` per chunk: CE by hand, then the divergence by its hand-written
``chunk_grad`` (:mod:`kdbench.distill.lm.divergences`), or, for a divergence that gives only its value,
by autograd through that value on the chunk.  Backward scales the stored gradients in place
(:func:`consume`), so it runs once per forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdbench.core.fakes import known_values, on_values
from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.lm.divergences import TokenLoss, resolved

__all__ = ["cast_head", "chunk_total", "chunk_value_grad", "consume", "head_logits", "valid_rows", "zero"]


def valid_rows(labels: torch.Tensor) -> torch.Tensor:
    """The indices of the (flattened) tokens whose label is not -100.  Finding them reads the labels back (a
    host-device sync on a GPU): a caller with a fixed batch finds them once and passes them to
    :func:`~kdbench.distill.lm.impls.lm_loss` (``rows``), so that no step synchronises."""
    if known_values(labels) is not None:  # a fit's fake labels (kdbench.fit): their rows found on their real values
        return on_values(labels, valid_rows)
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def cast_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The head in the hidden states' dtype, as autocast would run it (no copy when they agree)."""
    return weight.to(hidden.dtype), (bias.to(hidden.dtype) if bias is not None else None)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor):
    """The head's logits of ``rows`` of the (flattened) hidden states: the rows picked by index (their count is on
    the host: no boolean mask, whose size a GPU would sync for), the head cast as autocast would run it."""
    h = hidden.index_select(0, rows)
    return F.linear(h, *cast_head(h, weight, bias))


def chunk_total(n: int, chunk_size: int, device: torch.device, step) -> torch.Tensor:
    """The float32 sum of ``step(start, end)`` over the chunks [start, end) of rows 0..n, in order: each step
    returns its chunk's value and keeps its own gradient (written into the caller's buffer or accumulator)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for start in range(0, n, chunk_size):
        total += step(start, start + chunk_size)
    return total


def zero(*tensors: torch.Tensor | None) -> torch.Tensor:
    """A float32 0 attached to the graph of `tensors` (their empty slices' sums): zero, finite grads."""
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        if t is not None and t.requires_grad:
            total = total + t[:0].sum().float()
    return total


def chunk_value_grad(s, t, labels, loss: TokenLoss, n_valid: int, need_grad: bool, may_inf: bool = True):
    """A chunk's share of the loss and its gradient w.r.t. the chunk's student logits, float32.

    s: (C, V) float32 student logits of C valid tokens, t: the teacher's (any float dtype; None without a
    divergence); both buffers are this function's to overwrite (pass them without keeping a reference).
    Returns (value, grad or None): value = (ce_weight · Σ CE + kd_weight · T² · Σ D) / n_valid over the
    chunk, D as token_losses defines it (log-softmax at T; entries where either logit is infinite left
    out).  With the divergence's ``chunk_grad`` giving a = ∂L/∂log p_s + p_s·∂L/∂p_s on the kept entries (0
    on the others), the gradient w.r.t. z = s / T is a − softmax(z)·Σ_v a, the chain rule through
    token_losses' where + log_softmax.  Six to ten (C, V) float32 buffers are alive at its peak (forward KL
    + CE: 7; autograd through token_losses holds 13 for that loss).  ``may_inf`` False (heads without
    biases): no entry is infinite, none dropped.  A divergence without ``chunk_grad``: autograd through its
    ``value`` on the chunk.
    """
    value = torch.zeros((), dtype=torch.float32, device=s.device)
    grad = None
    if loss.has_ce:  # F.cross_entropy's sum: Σ logsumexp(s) − s[label]; gradient softmax(s) − onehot
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        value = value + loss.ce_weight / n_valid * (lse.sum() - s.gather(1, labels[:, None]).sum())
        if need_grad:
            grad = torch.sub(s, lse).exp_()
            grad.scatter_add_(1, labels[:, None], torch.full_like(lse, -1.0))
            grad.mul_(loss.ce_weight / n_valid)
        del lse
    if not loss.has_kd:
        return value, grad
    div, params = resolved(loss)
    if div.chunk_grad is None:
        part, g = _by_autograd(s, t, div.value, params, loss, n_valid, need_grad)
        return value + part, (g if grad is None or g is None else grad.add_(g))
    temp = loss.temperature
    z = s.div_(temp) if temp != 1.0 else s
    tz = t.float()
    tz = tz.div_(temp) if temp != 1.0 else tz
    del s, t
    # Infinite logits come from infinite biases (a padded vocabulary's -inf): ``may_inf`` is decided on the host
    # from the heads, so no chunk reads a value back (a host-device sync on a GPU) to find out.
    drop = torch.isinf(z) | torch.isinf(tz) if may_inf else None
    lsm = F.log_softmax(z, dim=-1)
    del z
    lt = F.log_softmax(tz, dim=-1)
    del tz
    ls = lsm if drop is None else lsm.masked_fill(drop, 0.0)
    if drop is not None:
        lt.masked_fill_(drop, 0.0)
    ps, pt = ls.exp(), lt.exp()
    if drop is not None:
        ps.masked_fill_(drop, 0.0)
        pt.masked_fill_(drop, 0.0)
    total, a = div.chunk_grad(ls, lt, ps, pt, **params)
    value = value + loss.kd_weight * temp**2 / n_valid * total
    if not need_grad:
        return value, grad
    del pt, lt
    if drop is not None:
        a.masked_fill_(drop, 0.0)
        ps = lsm.exp()  # softmax(z) on every entry, the dropped ones included
    a.addcmul_(ps, a.sum(dim=-1, keepdim=True), value=-1.0)  # ∂/∂z
    coef = loss.kd_weight * temp / n_valid  # × T² for the loss, × 1/T for z = s / T
    grad = a.mul_(coef) if grad is None else grad.add_(a, alpha=coef)
    return value, grad


def _by_autograd(s, t, value_fn, params, loss: TokenLoss, n_valid: int, need_grad: bool):
    """kd_weight · T² · Σ D / n_valid over the chunk and its gradient w.r.t. s, by autograd through ``value_fn``
    (the mean over the chunk's rows, × T²), which runs with grad mode on inside the Function's forward."""
    with torch.enable_grad():
        s = s.detach().requires_grad_(need_grad)
        part = value_fn(s, t, None, temperature=loss.temperature, **params) * (loss.kd_weight * s.shape[0] / n_valid)
        grad = torch.autograd.grad(part, s)[0] if need_grad else None
    return part.detach().float(), grad


def consume(ctx, grad_output) -> list[torch.Tensor | None]:
    """The gradients forward stored on ctx, scaled in place by grad_output; once only."""
    if ctx.grads is None:
        raise RuntimeError(TWICE)
    grads = [g.mul_(grad_output) if g is not None else None for g in ctx.grads]
    ctx.grads = None
    return grads


TWICE = (
    "kdbench's chunked/fused_linear LM loss scales its precomputed gradients in place: backward through it "
    "runs once (recompute the loss to backpropagate again)"
)
