"""Implementations of "LM heads + token loss": the same loss, computed at different memory costs.

Per token the student's final hidden state h_s, its head W_s (V × Hs, bias b_s optional), the
teacher's h_t and W_t (b_t), and a label (next token id; -100 = not counted).  The loss is::

    ce_weight · CE(h_s W_sᵀ + b_s, labels)  +  kd_weight · D(student logits, teacher logits)

CE averaged over the valid tokens (labels != -100), D one of :data:`DIVERGENCES` from
:mod:`kdbench.distill.lm.token_losses` (float32, mask = valid tokens, × T², 0 when no token is
valid).  The head matmuls run in the hidden states' dtype (as under autocast; a float32 head is cast
to it), everything after them in float32.  Teacher inputs are constants (never differentiated).

Implementations (:data:`LOSS_IMPLS`), all equal to ``dense`` in value and gradient:

* ``dense``: both logits whole (N × V each), the token_losses function, plain autograd.  The
  reference.
* ``chunked``: the logits whole (as the model's head makes them), the float32 work per chunk of
  valid tokens inside one autograd.Function that writes each chunk's gradient into one buffer
  shaped like the student logits, in their dtype: the N × V tensors are the two logits and that
  buffer, never a float32 upcast of 16-bit logits (torchtune's ``ForwardKLWithChunkedOutputLoss``
  upcasts per chunk too, but keeps every chunk's autograd graph until backward).
* ``fused_linear``: heads and loss fused, per chunk of valid tokens: the chunk's logits, loss and
  gradients w.r.t. h_s, W_s, b_s, all in the forward (Liger-Kernel's design); no N × V tensor.

Both compute a chunk's value and gradient by hand (:func:`_chunk_value_grad`, every divergence,
token_losses' conventions included), not by autograd on the chunk: 7 float32 chunk buffers at the
peak for forward KL + CE instead of 13.
* ``liger``: Liger-Kernel's ``LigerFusedLinearJSDLoss`` (``liger_kernel.chunked_loss``, pure
  torch): forward KL, reverse KL, JSD and CE only.
* ``torch_linear``: ``torch.nn.functional.linear_cross_entropy``'s chunked path: CE, and forward KL
  through probability targets (the teacher's probabilities are materialised, n_valid × V).

Sources read: linkedin/Liger-Kernel 0.8.5 as installed (``chunked_loss/fused_linear_distillation.py``,
``chunked_loss/jsd_loss.py``, ``ops/fused_linear_jsd.py``; the same design at ead96b61 on GitHub);
pytorch/torchtune bd2a0fc7 ``torchtune/modules/loss/kd_losses.py``; torch 2.14
``F.linear_cross_entropy`` and ``torch.nn.LinearCrossEntropyOptions`` docstrings.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kdbench.distill.lm import token_losses
from kdbench.distill.lm.token_losses import _log_mixture
from kdbench.errors import KdbenchError, did_you_mean

__all__ = [
    "DIVERGENCES",
    "IGNORE_INDEX",
    "LOSS_IMPLS",
    "TokenLoss",
    "liger_beta",
    "lm_loss",
    "logits_memory",
    "unavailable",
    "unsupported",
]

LOSS_IMPLS = ("dense", "chunked", "fused_linear", "liger", "torch_linear")
IGNORE_INDEX = -100

DIVERGENCES: dict[str, Callable[..., torch.Tensor]] = {
    "forward_kl": token_losses.forward_kl,
    "reverse_kl": token_losses.reverse_kl,
    "jsd": token_losses.generalized_jsd,
    "tv": token_losses.total_variation,
    "skew_forward_kl": token_losses.skew_forward_kl,
    "skew_reverse_kl": token_losses.skew_reverse_kl,
}


@dataclass(frozen=True)
class TokenLoss:
    """What to compute: ``ce_weight · CE + kd_weight · D`` (D = ``divergence``; None: CE only)."""

    divergence: str | None = None  # a DIVERGENCES key, or None: CE only
    temperature: float = 1.0
    beta: float = 0.5  # jsd: beta = 0 forward KL, 1 reverse KL (TRL >= 0.16)
    lam: float = 0.1  # skew_*: the mixture's share of the first distribution (DistiLLM)
    kd_weight: float = 1.0
    ce_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.divergence is not None and self.divergence not in DIVERGENCES:
            raise KdbenchError(
                f"unknown divergence {self.divergence!r}: {did_you_mean(self.divergence, DIVERGENCES, quote=True)}"
                f"choose one of {', '.join(DIVERGENCES)}, or None for CE only"
            )
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise KdbenchError(f"temperature must be a positive number, got {self.temperature}")
        for name in ("beta", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise KdbenchError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        for name in ("kd_weight", "ce_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise KdbenchError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def has_kd(self) -> bool:
        return self.divergence is not None and self.kd_weight != 0

    @property
    def has_ce(self) -> bool:
        return self.ce_weight != 0


def _check_impl(impl: str) -> None:
    if impl not in LOSS_IMPLS:
        raise KdbenchError(
            f"unknown LM loss implementation {impl!r}: {did_you_mean(impl, LOSS_IMPLS, quote=True)}"
            f"choose one of {', '.join(LOSS_IMPLS)}"
        )


def liger_beta(loss: TokenLoss) -> float | None:
    """The beta of liger's generalised JSD that computes ``loss.divergence``, None if none does.

    Liger's ``distillation_loss_fn`` (jsd_loss.py) mixes m = beta·p_T + (1 − beta)·p_S and is
    ``beta·KL(p_T‖m) + (1 − beta)·KL(p_S‖m)``, forward KL at beta = 0 and reverse KL at 1, special-
    cased: TRL's (and kdbench's) convention.  The skew KLs at lam = 0 are those KLs too.
    """
    d = loss.divergence
    if d == "forward_kl" or (d == "skew_forward_kl" and loss.lam == 0.0):
        return 0.0
    if d == "reverse_kl" or (d == "skew_reverse_kl" and loss.lam == 0.0):
        return 1.0
    if d == "jsd":
        return float(loss.beta)
    return None


def _is_forward_kl(loss: TokenLoss) -> bool:
    return liger_beta(loss) == 0.0


def unsupported(impl: str, loss: TokenLoss) -> str | None:
    """None when `impl` can compute `loss`, else the reason (names the impl and what to use instead).

    Pure logic, no optional import: usable at plan time.  ``dense``, ``chunked`` and
    ``fused_linear`` compute every divergence; ``liger`` the generalised JSD family (forward KL,
    reverse KL, jsd; the skew KLs only at lam = 0); ``torch_linear`` CE and forward KL.
    """
    _check_impl(impl)
    if not loss.has_kd or impl in ("dense", "chunked", "fused_linear"):
        return None
    if impl == "liger":
        if liger_beta(loss) is not None:
            return None
        what = f"{loss.divergence} at lam={loss.lam}" if loss.divergence.startswith("skew_") else loss.divergence
        return (
            f"liger cannot compute {what}: liger_kernel.chunked_loss's only distillation loss is "
            "LigerFusedLinearJSDLoss (generalised JSD: forward KL at beta 0, reverse KL at beta 1); use fused_linear "
            "(the same fused design, every divergence)"
        )
    if _is_forward_kl(loss):
        return None
    return (
        f"torch_linear cannot compute {loss.divergence}: F.linear_cross_entropy is a cross-entropy against fixed "
        "targets, which gives the forward KL (targets = the teacher's probabilities) and no divergence that depends "
        "on the student's probabilities otherwise; use fused_linear"
    )


def unavailable(impl: str) -> str | None:
    """None when `impl` can run in this environment, else why and the fix (detected by feature)."""
    _check_impl(impl)
    if impl == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger needs liger-kernel, which is not installed: pip install liger-kernel"
        try:
            from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction
        except Exception as exc:  # liger imports triton and more; any failure means it cannot run here
            return f"liger: liger_kernel.chunked_loss does not import here ({type(exc).__name__}: {exc})"
        # Before PR #974 (liger 0.6.5, commit 33f7f487) the JSD loss ignored ignore_index and averaged
        # over all tokens; its distillation_loss_fn gained the `ignore_index` parameter with that fix.
        if "ignore_index" not in inspect.signature(LigerFusedLinearJSDFunction.distillation_loss_fn).parameters:
            return (
                "liger: this liger-kernel's JSD loss counts the -100 (ignored) tokens (fixed in liger-kernel 0.6.5): "
                "pip install -U liger-kernel"
            )
        return None
    if impl == "torch_linear" and not (
        hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
    ):
        return (
            f"torch_linear needs torch.nn.functional.linear_cross_entropy and its chunked path "
            f"(torch.nn.LinearCrossEntropyOptions), which torch {torch.__version__} does not have: "
            "install a torch that has them"
        )
    return None


# ------------------------------------------------------------------------------------------------
# shared pieces


def _divergence(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None, loss: TokenLoss):
    fn = DIVERGENCES[loss.divergence]
    kwargs: dict[str, Any] = {"temperature": loss.temperature}
    if loss.divergence == "jsd":
        kwargs["beta"] = loss.beta
    elif loss.divergence.startswith("skew_"):
        kwargs["lam"] = loss.lam
    return fn(student, teacher, mask, **kwargs)


def _chunk_value_grad(s, t, labels, loss: TokenLoss, n_valid: int, need_grad: bool, may_inf: bool = True):
    """A chunk's share of the loss and its gradient w.r.t. the chunk's student logits, by hand, float32.

    s: (C, V) float32 student logits of C valid tokens, t: the teacher's (any float dtype; None without a
    divergence); both buffers are this function's to overwrite (pass them without keeping a reference).
    Returns (value, grad or None): value = (ce_weight · Σ CE + kd_weight · T² · Σ D) / n_valid over the
    chunk, D as token_losses defines it (log-softmax at T; entries where either logit is infinite left
    out).  With a = ∂L/∂log p_s + p_s·∂L/∂p_s on the kept entries (0 on the others), the gradient w.r.t.
    z = s / T is a − softmax(z)·Σ_v a, the chain rule through token_losses' where + log_softmax.  Six to
    ten (C, V) float32 buffers are alive at its peak (forward KL + CE: 7; autograd through token_losses
    holds 13 for that loss).  ``may_inf`` False (heads without biases): no entry is infinite, none dropped.
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
    kind, w = _canonical(loss)
    if kind == "forward_kl":  # L = p_t (log p_t − log p_s); a = −p_t
        a = torch.sub(lt, ls).mul_(pt)
        total = a.sum()
        torch.neg(pt, out=a)
    elif kind == "reverse_kl":  # L = p_s (log p_s − log p_t); a = p_s (1 + log p_s − log p_t)
        a = torch.sub(ls, lt).mul_(ps)
        total = a.sum()
        a.add_(ps)
    elif kind == "tv":  # L = ½|p_t − p_s|; a = −½ p_s sign(p_t − p_s)
        a = torch.sub(pt, ps)
        total = 0.5 * a.abs().sum()
        a.sign_().mul_(ps).mul_(-0.5)
    elif kind == "skew_forward_kl":
        # m = w p_t + (1 − w) p_s; L = p_t (log p_t − log m); a = −(1 − w) p_t p_s / m
        lm = _log_mixture(lt, ls, w)
        a = torch.sub(lt, lm).mul_(pt)
        total = a.sum()
        torch.sub(ls, lm, out=a).exp_().mul_(pt).mul_(-(1.0 - w))
    elif kind == "skew_reverse_kl":
        # m = w p_s + (1 − w) p_t; L = p_s (log p_s − log m); a = p_s (1 + log p_s/m − w p_s/m)
        lm = _log_mixture(ls, lt, w)
        a = torch.sub(ls, lm)
        ratio = a.exp()
        a.mul_(ps)
        total = a.sum()
        a.add_(ps).sub_(ratio.mul_(ps), alpha=w)
        del ratio
    else:  # jsd, 0 < w < 1: m = w p_t + (1 − w) p_s; L = w p_t log(p_t/m) + (1 − w) p_s log(p_s/m)
        # a = (1 − w) p_s log(p_s/m): the terms through m sum to −(1 − w) p_s, cancelling ∂L/∂log p_s's own
        lm = _log_mixture(lt, ls, w)
        a = torch.sub(lt, lm).mul_(pt)
        total = w * a.sum()
        torch.sub(ls, lm, out=a).mul_(ps)
        total = total + (1.0 - w) * a.sum()
        a.mul_(1.0 - w)
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


def _canonical(loss: TokenLoss) -> tuple[str, float]:
    """The divergence token_losses actually computes, and its mixture weight: jsd at beta 0 / 1 is the
    forward / reverse KL (its special cases)."""
    if loss.divergence == "jsd":
        if loss.beta == 0.0:
            return "forward_kl", 0.0
        if loss.beta == 1.0:
            return "reverse_kl", 0.0
        return "jsd", float(loss.beta)
    return loss.divergence, float(loss.lam)


def _cast_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The head in the hidden states' dtype, as autocast would run it (no copy when they agree)."""
    return weight.to(hidden.dtype), (bias.to(hidden.dtype) if bias is not None else None)


def _zero(*tensors: torch.Tensor) -> torch.Tensor:
    """A float32 0 attached to the graph of `tensors` (their empty slices' sums): zero, finite grads."""
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        if t is not None and t.requires_grad:
            total = total + t[:0].sum().float()
    return total


def valid_rows(labels: torch.Tensor) -> torch.Tensor:
    """The indices of the (flattened) tokens whose label is not -100.  Finding them reads the labels back (a
    host-device sync on a GPU): a caller with a fixed batch finds them once and passes them to :func:`lm_loss`
    (``rows``), so that no step synchronises."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


# ------------------------------------------------------------------------------------------------
# dense


def _dense(hs, ws, bs, ht, wt, bt, labels, loss: TokenLoss, rows: torch.Tensor) -> torch.Tensor:
    w, b = _cast_head(hs, ws, bs)
    logits_s = F.linear(hs, w, b)
    n_valid = rows.numel()
    total = _zero(hs, ws, bs)  # attached even where D ignores the student (skew_forward_kl at lam = 1)
    if loss.has_ce:  # sum / max(n, 1): cross_entropy's "mean", but 0 (not NaN) when no token counts
        ce = F.cross_entropy(logits_s.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        total = total + loss.ce_weight * ce / max(n_valid, 1)
    if loss.has_kd:
        with torch.no_grad():
            logits_t = F.linear(ht, *_cast_head(ht, wt, bt))
        # the valid rows by index (their count is on the host): no boolean mask, whose size a GPU would sync for
        selected = logits_s.index_select(0, rows), logits_t.index_select(0, rows)
        total = total + loss.kd_weight * _divergence(*selected, None, loss)
    return total


# ------------------------------------------------------------------------------------------------
# chunked: whole logits, float32 work and the logits' gradient per chunk


class _ChunkedLogitsLoss(torch.autograd.Function):
    """loss(student logits, teacher logits); the gradient w.r.t. the student logits is computed in
    forward, chunk by chunk of valid tokens (:func:`_chunk_value_grad`), into one zero-filled buffer in
    the logits' dtype; backward scales it in place (so a second backward through the graph raises)."""

    @staticmethod
    def forward(ctx, logits_s, logits_t, labels, loss: TokenLoss, chunk_size: int, grad_enabled: bool, rows, may_inf):
        n_valid = rows.numel()
        grad = torch.zeros_like(logits_s) if grad_enabled and ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=logits_s.device)
        for start in range(0, n_valid, chunk_size):
            idx = rows[start : start + chunk_size]
            part, g = _chunk_value_grad(
                logits_s.index_select(0, idx).float(),
                logits_t.index_select(0, idx) if loss.has_kd else None,
                labels.index_select(0, idx),
                loss,
                n_valid,
                grad is not None,
                may_inf,
            )
            total += part
            if g is not None:
                grad.index_copy_(0, idx, g.to(grad.dtype))
        ctx.grads = [grad]
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return (*_consume(ctx, grad_output), None, None, None, None, None, None, None)


def _consume(ctx, grad_output) -> list[torch.Tensor | None]:
    """The gradients forward stored on ctx, scaled in place by grad_output; once only."""
    if ctx.grads is None:
        raise RuntimeError(_TWICE)
    grads = [g.mul_(grad_output) if g is not None else None for g in ctx.grads]
    ctx.grads = None
    return grads


_TWICE = (
    "kdbench's chunked/fused_linear LM loss scales its precomputed gradients in place: backward through it "
    "runs once (recompute the loss to backpropagate again)"
)


def _chunked(hs, ws, bs, ht, wt, bt, labels, loss: TokenLoss, rows: torch.Tensor, chunk_size: int) -> torch.Tensor:
    logits_s = F.linear(hs, *_cast_head(hs, ws, bs))
    with torch.no_grad():
        logits_t = F.linear(ht, *_cast_head(ht, wt, bt)) if loss.has_kd else logits_s.new_empty(logits_s.shape[0], 0)
    # forward runs with grad mode off: whether a gradient is wanted at all is decided here
    may_inf = bs is not None or bt is not None  # only an infinite bias makes a logit infinite
    return _ChunkedLogitsLoss.apply(
        logits_s, logits_t, labels, loss, chunk_size, torch.is_grad_enabled(), rows, may_inf
    )


# ------------------------------------------------------------------------------------------------
# fused_linear: heads and loss per chunk of tokens, all gradients in forward


class _FusedLinearLoss(torch.autograd.Function):
    """loss(h_s, W_s, b_s, h_t, W_t, b_t); per chunk of valid tokens: the chunk's logits (model dtype),
    its float32 loss and gradient g w.r.t. its student logits (:func:`_chunk_value_grad`), then
    grad_h = g W, grad_W += gᵀ h (float32 accumulator), grad_b += Σ g.  Backward scales them in place."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, labels, loss: TokenLoss, chunk_size: int, grad_enabled: bool, rows):
        w, b = _cast_head(hs, ws, bs)
        w_t, b_t = _cast_head(ht, wt, bt)
        need_h, need_w, need_b = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        n_valid = rows.numel()
        f32 = torch.float32
        grad_h = torch.zeros_like(hs) if need_h else None
        grad_w = torch.zeros(ws.shape, dtype=f32, device=ws.device) if need_w else None
        grad_b = torch.zeros(bs.shape, dtype=f32, device=bs.device) if need_b else None
        total = torch.zeros((), dtype=f32, device=hs.device)
        for start in range(0, n_valid, chunk_size):
            idx = rows[start : start + chunk_size]
            h = hs.index_select(0, idx)
            part, g = _chunk_value_grad(
                F.linear(h, w, b).float(),
                F.linear(ht.index_select(0, idx), w_t, b_t) if loss.has_kd else None,
                labels.index_select(0, idx),
                loss,
                n_valid,
                need_h or need_w or need_b,
                bs is not None or bt is not None,  # only an infinite bias makes a logit infinite
            )
            total += part
            if g is None:
                continue
            if need_b:
                grad_b.add_(g.sum(0))
            g = g.to(hs.dtype)  # the gradient w.r.t. the model-dtype logits, as autograd's cast back would give
            if need_h:
                grad_h.index_copy_(0, idx, (g @ w).to(grad_h.dtype))  # .to: autocast may run the mm lower
            if need_w:
                if g.dtype == f32:
                    grad_w.addmm_(g.t(), h)
                else:
                    grad_w.add_(g.t() @ h)
            del g
        ctx.grads = [
            grad_h,
            grad_w.to(ws.dtype) if need_w else None,
            grad_b.to(bs.dtype) if need_b else None,
        ]
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return (*_consume(ctx, grad_output), None, None, None, None, None, None, None, None)


def _fused_linear(hs, ws, bs, ht, wt, bt, labels, loss: TokenLoss, rows, chunk_size: int) -> torch.Tensor:
    return _FusedLinearLoss.apply(hs, ws, bs, ht, wt, bt, labels, loss, chunk_size, torch.is_grad_enabled(), rows)


# ------------------------------------------------------------------------------------------------
# liger


def _liger(hs, ws, bs, ht, wt, bt, labels, loss: TokenLoss, rows, chunk_size: int, compiled: bool) -> torch.Tensor:
    """Liger's ``LigerFusedLinearJSDLoss`` (liger-kernel >= 0.6.5) with kdbench's TokenLoss mapped so
    that its value equals dense's.  Liger's conventions and the mapping:

    * beta: the same as TRL's and kdbench's (m = beta·p_T + (1 − beta)·p_S, forward KL at beta = 0,
      reverse at 1): :func:`liger_beta`.
    * temperature: liger divides both logits by T but does not multiply by T²:
      ``weight_soft_loss = kd_weight · T²``.
    * normalisation: liger sums each term over the non-ignored tokens and divides by their count
      (clamped to 1), as kdbench does; its hard loss is the CE of the un-tempered logits, float32:
      ``weight_hard_loss = ce_weight``.
    * not converted: liger computes the divergence in the logits' dtype (no float32 upcast: bf16 stays
      bf16), does not drop infinite logits, and splits N tokens into max(1, N // chunk_size) equal
      chunks (each of chunk_size to 2·chunk_size − 1 rows).
    """
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    # CE only: liger computes the soft loss all the same (weighted 0); at beta 0 it is cheapest
    beta = liger_beta(loss) if loss.has_kd else 0.0
    fn = LigerFusedLinearJSDLoss(
        weight_hard_loss=loss.ce_weight,
        weight_soft_loss=loss.kd_weight * loss.temperature**2 if loss.has_kd else 0.0,
        beta=beta,
        ignore_index=IGNORE_INDEX,
        temperature=loss.temperature,
        compiled=compiled,
        chunk_size=chunk_size,
    )
    w, b = _cast_head(hs, ws, bs)
    w_t, b_t = _cast_head(ht, wt, bt)
    return fn(hs, w, ht, w_t, labels, b, b_t).float()


# ------------------------------------------------------------------------------------------------
# torch_linear


def _torch_linear(hs, ws, bs, ht, wt, bt, labels, loss: TokenLoss, rows, chunk_size: int) -> torch.Tensor:
    """CE with class-index targets; forward KL as CE with the teacher's probabilities as targets
    (CE(p_T) = KL(p_T‖p_S) + H(p_T): H(p_T) is computed per chunk without grad and subtracted, so
    the value is the true KL).  The targets must have the input's dtype for the chunked path (else
    torch falls back to the reference path, which materialises the logits): in bf16 they are rounded.
    """
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size)
    w, b = _cast_head(hs, ws, bs)
    n_valid = rows.numel()
    total = _zero(hs, ws, bs)
    if n_valid == 0:
        return total
    if loss.has_ce:
        ce = F.linear_cross_entropy(
            hs, w, labels, linear_bias=b, reduction="sum", ignore_index=IGNORE_INDEX, options=options
        )
        total = total + loss.ce_weight * ce.float() / n_valid
    if loss.has_kd:
        temp = loss.temperature
        w_t, b_t = _cast_head(ht, wt, bt)
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


# ------------------------------------------------------------------------------------------------
# the entry point


def lm_loss(
    impl: str,
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    labels: torch.Tensor,
    loss: TokenLoss,
    chunk_size: int = 1024,
    *,
    liger_compiled: bool = False,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ce_weight · CE + kd_weight · D`` of the student and teacher heads, computed by `impl`.

    hidden: (B, S, H) or (N, H); labels: (B, S) or (N,), long, -100 = not counted.  Returns a float32
    scalar, differentiable w.r.t. the student's hidden states, weight and bias; the teacher's inputs
    are constants.  `chunk_size` (tokens per chunk, >= 1) applies to every impl but ``dense``.
    `rows`: the valid tokens' indices (:func:`valid_rows`), when the caller found them once for a fixed batch;
    without them they are found here, which reads the labels back (a host-device sync on a GPU).
    `liger_compiled` is liger's ``compiled`` (torch.compile of each chunk's step; liger's own default
    is True, off here: a compile costs seconds on first use, and needs a C++ compiler on the CPU).
    The chunked, fused_linear and torch_linear impls compute gradients in forward and support one
    backward per forward (no retain_graph reuse, no double backward).
    """
    _check_impl(impl)
    if not (loss.has_ce or loss.has_kd):
        raise KdbenchError("the LM loss has no term: set a divergence with kd_weight > 0, or ce_weight > 0")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise KdbenchError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    reason = unsupported(impl, loss)
    if reason is None:
        reason = unavailable(impl)
    if reason is not None:
        raise KdbenchError(reason)
    hs, ht, lab = _flatten(student_hidden, student_weight, teacher_hidden, teacher_weight, labels)
    for name, bias, weight in (("student", student_bias, student_weight), ("teacher", teacher_bias, teacher_weight)):
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise KdbenchError(f"the {name} bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    teacher = [t.detach() if t is not None else None for t in (ht, teacher_weight, teacher_bias)]
    rows = valid_rows(lab) if rows is None else rows
    args = (hs, student_weight, student_bias, *teacher, lab, loss, rows)
    if impl == "dense":
        return _dense(*args)
    if impl == "chunked":
        return _chunked(*args, chunk_size)
    if impl == "fused_linear":
        return _fused_linear(*args, chunk_size)
    if impl == "liger":
        return _liger(*args, chunk_size, liger_compiled)
    return _torch_linear(*args, chunk_size)


def _flatten(hs, ws, ht, wt, labels):
    """(N, H) hidden states and (N,) labels, after checking the shapes agree."""
    if hs.dim() not in (2, 3) or ht.dim() != hs.dim():
        raise KdbenchError(
            f"hidden states must both be (B, S, H) or (N, H), got {tuple(hs.shape)} and {tuple(ht.shape)}"
        )
    if tuple(labels.shape) != tuple(hs.shape[:-1]) or tuple(ht.shape[:-1]) != tuple(hs.shape[:-1]):
        raise KdbenchError(
            f"labels {tuple(labels.shape)} and the teacher's hidden states {tuple(ht.shape)} must match the "
            f"student's hidden states {tuple(hs.shape)} without the hidden axis"
        )
    if labels.dtype != torch.long:
        raise KdbenchError(f"labels must be torch.long token ids, got {labels.dtype}")
    for name, h, w in (("student", hs, ws), ("teacher", ht, wt)):
        if w.dim() != 2 or w.shape[1] != h.shape[-1]:
            raise KdbenchError(f"the {name} head must be (V, {h.shape[-1]}), got {tuple(w.shape)}")
    if ws.shape[0] != wt.shape[0]:
        raise KdbenchError(f"student and teacher vocabularies differ: {ws.shape[0]} vs {wt.shape[0]}")
    return hs.reshape(-1, hs.shape[-1]), ht.reshape(-1, ht.shape[-1]), labels.reshape(-1)


# ------------------------------------------------------------------------------------------------
# computed logits memory


# Buffers of the peak, counted with a dispatch mode that tracks every storage created (N = 512, V = 4000,
# chunk 64, every token valid, float32 and bf16 logits), rounded to 1/4 (a bool mask is 1/4 of a float32
# buffer).  _DENSE_FP32: dense's float32 (N, V) buffers beside its two logits: the float32 copies of the
# valid rows, the log-softmaxes, token_losses' four where() outputs, the exps, its drop mask, the
# divergence's mixture.  _CHUNK_FP32: the float32 (C, V) working set of _chunk_value_grad (chunked and
# fused_linear).  _LIGER: liger's (C', V) working set (autograd on its chunk), measured with float32 logits.
_DENSE_FP32 = {
    "forward_kl": 9.25,
    "reverse_kl": 9.25,
    "tv": 9.25,
    "jsd": 15.25,
    "skew_forward_kl": 11.25,
    "skew_reverse_kl": 12.25,
}
_CHUNK_FP32 = {"forward_kl": 6, "reverse_kl": 6, "tv": 7, "jsd": 9, "skew_forward_kl": 9, "skew_reverse_kl": 9}
_LIGER = {0.0: 8.25, 1.0: 9.25}  # by liger's beta; any other beta: 18.25
_DTYPE_NAMES = {2: "16-bit", 4: "fp32", 8: "fp64"}


def logits_memory(
    impl: str, n_tokens: int, vocab: int, logits_dtype_bytes: int, chunk_size: int, loss: TokenLoss
) -> dict[str, Any]:
    """Estimated bytes of the logits-sized buffers `impl` holds at its peak, from shapes alone.

    Counts the (n_tokens, vocab) buffers (in the logits' dtype, and float32) and the (chunk, vocab)
    buffers alive at the peak of one forward + backward, every token valid; not the hidden states, the
    heads or their gradients, nor the allocator's slack.  The counts are the tables above, taken with a
    dispatch mode that tracks every storage.  Against the rise of VmHWM (forward KL + CE, 4096 tokens,
    V = 32000, chunk 1024, fp32; benchmarks/bench_lm_loss_memory.py, 3 runs on a 2-core CPU), estimated
    / measured MiB: dense 6125 / 6125-6143, chunked 2375 / 2395-2492, fused_linear 875 / 812-844,
    liger 1281 / 1187-1362, torch_linear 1125 / 883-1074; the measurements include W_s's and h_s's
    gradients (70 MiB).  With masked tokens dense's float32 buffers shrink to the valid rows, and
    chunked's and fused_linear's chunks walk the valid rows only.

    Returns ``bytes``, ``buffers`` (how many (n_tokens, vocab) buffers), ``chunk_buffers`` (how many
    (chunk_rows, vocab) ones), ``chunk_rows`` and ``text``, e.g.
    ``"2 × 4096×32000 fp32 (logits) + 10.25 × 4096×32000 fp32 (float32 work) = 6125 MiB"``.
    """
    _check_impl(impl)
    if chunk_size < 1 or n_tokens < 0 or vocab < 1:
        raise KdbenchError(f"need chunk_size >= 1, n_tokens >= 0, vocab >= 1; got {chunk_size}, {n_tokens}, {vocab}")
    ce, kd = loss.has_ce, loss.has_kd
    div = _canonical(loss)[0] if kd else None
    low = logits_dtype_bytes < 4
    rows = min(chunk_size, n_tokens)
    full: list[tuple[float, int, str]] = []  # (count, bytes per entry, what) of (n_tokens, vocab) buffers
    chunk: list[tuple[float, int, str]] = []  # the same of (rows, vocab) buffers
    if impl == "dense":
        full.append((2 if kd else 1, logits_dtype_bytes, "logits"))
        full.append(((_DENSE_FP32[div] if kd else 1) + (1 if ce else 0), 4, "float32 work"))
    elif impl in ("chunked", "fused_linear"):
        if impl == "chunked":
            full.append((3 if kd else 2, logits_dtype_bytes, "logits, their gradient"))
        chunk.append(((_CHUNK_FP32[div] if kd else 2) + (1 if ce else 0), 4, "float32 work"))
        if low:  # the chunk's logits (fused: and its gradient) in their own dtype
            chunk.append((3 if impl == "fused_linear" else 1, logits_dtype_bytes, "logits"))
    elif impl == "liger":
        rows = -(-n_tokens // max(1, n_tokens // chunk_size)) if n_tokens else 0  # torch.chunk into N // C parts
        beta = liger_beta(loss) if kd else 0.0
        chunk.append((_LIGER.get(beta, 18.25) + (2 if ce else 0), 4, "liger's work, fp32-equivalent"))
    else:
        if kd:
            full.append((1, logits_dtype_bytes, "teacher probabilities"))
        chunk.append(((4 if kd else 3) + (1 if ce and kd else 0), 4, "float32 work"))

    def size(parts, n_rows):
        return sum(count * n_rows * vocab * nbytes for count, nbytes, _ in parts)

    def words(parts, n_rows):
        return [f"{c:g} × {n_rows}×{vocab} {_DTYPE_NAMES.get(b, f'{b}-byte')} ({what})" for c, b, what in parts]

    total = int(size(full, n_tokens) + size(chunk, rows))
    text = " + ".join(words(full, n_tokens) + words(chunk, rows))
    return {
        "bytes": total,
        "buffers": sum(c for c, _, _ in full),
        "chunk_buffers": sum(c for c, _, _ in chunk),
        "chunk_rows": rows,
        "text": f"{text} = {total / 2**20:.0f} MiB",
    }
