"""``liger``: Liger-Kernel's ``LigerFusedLinearJSDLoss`` (``liger_kernel.chunked_loss``, pure torch), the
generalised JSD family: forward KL, reverse KL, jsd, and the skew KLs at lam = 0 (those KLs); CE.  A
divergence runs under it where its record gives a ``liger_beta``.

Sources read: linkedin/Liger-Kernel 0.8.5 as installed (``chunked_loss/fused_linear_distillation.py``,
``chunked_loss/jsd_loss.py``, ``ops/fused_linear_jsd.py``; the same design at ead96b61 on GitHub).
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

from kdbench.core.install import extra_hint
from kdbench.core.names import IGNORE_INDEX
from kdbench.distill.lm.divergences import TokenLoss, get_divergence, liger_beta
from kdbench.distill.lm.impls.base import Buffers, Heads, LossImpl, Settings, register_impl
from kdbench.distill.lm.impls.chunks import cast_head


def compute(heads: Heads, loss: TokenLoss, rows: torch.Tensor, settings: Settings) -> torch.Tensor:
    """Liger's ``LigerFusedLinearJSDLoss`` (liger-kernel >= 0.6.5) with kdbench's TokenLoss mapped so
    that its value equals dense's.  Liger's conventions and the mapping:

    * beta: the same as TRL's and kdbench's (m = beta·p_T + (1 − beta)·p_S, forward KL at beta = 0,
      reverse at 1): :func:`~kdbench.distill.lm.divergences.liger_beta`.
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
        compiled=settings.liger_compiled,
        chunk_size=settings.chunk_size,
    )
    h = heads
    w, b = cast_head(h.student_hidden, h.student_weight, h.student_bias)
    w_t, b_t = cast_head(h.teacher_hidden, h.teacher_weight, h.teacher_bias)
    return fn(h.student_hidden, w, h.teacher_hidden, w_t, h.labels, b, b_t).float()


def unsupported(loss: TokenLoss) -> str | None:
    """None where the divergence's record maps it to a beta of liger's generalised JSD."""
    if liger_beta(loss) is not None:
        return None
    what = get_divergence(loss.divergence).describe(loss.kwargs)
    return (
        f"liger cannot compute {what}: liger_kernel.chunked_loss's only distillation loss is "
        "LigerFusedLinearJSDLoss (generalised JSD: forward KL at beta 0, reverse KL at beta 1); use fused_linear "
        "(the same fused design, every divergence)"
    )


def unavailable() -> str | None:
    """liger-kernel installed and importable, with its JSD loss's ignore_index (detected by feature)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger needs liger-kernel, which is not installed: {extra_hint('liger')}"
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


SYNC_NOTE = (
    "liger syncs host and device once per step: its backward (LigerFusedLinearDistillationBase.backward) tests "
    "torch.ne(grad_output, torch.tensor(1.0, device=...)) on the host, a host-to-device copy and a read back; "
    "kdbench's own loss_impls make no sync"
)


def note() -> str:
    """The sync liger's backward makes, where this liger-kernel's backward reads ``grad_output`` on the host (0.8.5:
    ``if torch.ne(grad_output, torch.tensor(1.0, device=grad_output.device))``, read from its source)."""
    try:
        from liger_kernel.chunked_loss.fused_linear_distillation import LigerFusedLinearDistillationBase

        source = inspect.getsource(LigerFusedLinearDistillationBase.backward)
    except Exception:  # not installed (the cell is skipped) or no source to read
        return ""
    return SYNC_NOTE if "torch.ne(grad_output" in "".join(source.split()) else ""


# liger's (C', V) working set by its beta (autograd on its chunk), measured with float32 logits; any other beta:
# 18.25; + 2 with CE
_WORK = {0.0: 8.25, 1.0: 9.25}


def buffers(loss: TokenLoss, n_tokens: int, chunk_size: int, dtype_bytes: int) -> Buffers:
    """No N × V buffer; liger's work per chunk, in chunks of torch.chunk into max(1, N // C) parts."""
    rows = -(-n_tokens // max(1, n_tokens // chunk_size)) if n_tokens else 0
    beta = liger_beta(loss) if loss.has_kd else 0.0
    work = _WORK.get(beta, 18.25) + (2 if loss.has_ce else 0)
    return Buffers((), ((work, 4, "liger's work, fp32-equivalent"),), rows)


NEEDS = "liger-kernel >= 0.6.5 (the `liger` extra)"
register_impl(  # chunks every token
    LossImpl(
        "liger",
        compute,
        buffers,
        unsupported,
        unavailable,
        valid_only=False,
        note=note,
        needs=NEEDS,
        inf_why="Liger-Kernel's fused JSD does not leave infinite logits out: a -inf logit under the other model's "
        "mass makes its loss inf or NaN",
        uld_why="Liger-Kernel's fused JSD compares two heads over one vocabulary on the same token rows, and has no "
        "sorted-probability (ULD) loss",
    )
)
