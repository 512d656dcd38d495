"""Implementations of "LM heads + token loss": the same loss, computed at different memory costs.

Per token the student's final hidden state h_s, its head W_s (V × Hs, bias b_s optional), the
teacher's h_t and W_t (b_t), and a label (next token id; -100 = not counted).  The loss is::

    ce_weight · CE(h_s W_sᵀ + b_s, labels)  +  kd_weight · D(student logits, teacher logits)

CE averaged over the valid tokens (labels != -100), D a registered divergence
(:mod:`kdbench.distill.lm.divergences`; float32, mask = valid tokens, × T², 0 when no token is valid).
The head matmuls run in the hidden states' dtype (as under autocast; a float32 head is cast to it),
everything after them in float32.  Teacher inputs are constants (never differentiated).

One module per implementation, each a :class:`~kdbench.distill.lm.impls.base.LossImpl` record in
:data:`~kdbench.distill.lm.impls.base.IMPLS` (:data:`LOSS_IMPLS`: their names, in this order), all equal to
``dense`` in value and gradient:

* ``dense`` (:mod:`.dense`): both logits of the valid tokens, the float32 loss, plain autograd.  The
  reference, written as a careful user writes it.  Every divergence.
* ``natural`` (:mod:`.natural`): the dense loss as TRL's GKD trainer and torchtune's KD recipe compute it: both
  heads on every position, the float32 loss masked afterwards, ``F.cross_entropy`` beside it, plain autograd.
  What a user's script runs; ``dense`` saves its work on the masked positions and CE's second log-softmax.
  Every divergence.
* ``chunked`` (:mod:`.chunked`): the logits whole, the float32 work and the logits' gradient per chunk
  of valid tokens.  Every divergence.
* ``fused_linear`` (:mod:`.fused_linear`): heads and loss fused per chunk of valid tokens, all gradients
  in the forward (Liger-Kernel's design); no N × V tensor.  Every divergence.
* ``liger`` (:mod:`.liger`): Liger-Kernel's ``LigerFusedLinearJSDLoss``: a divergence whose record gives
  a liger beta (forward KL, reverse KL, jsd; the skew KLs at lam = 0).
* ``torch_linear`` (:mod:`.torch_linear`): ``F.linear_cross_entropy``'s chunked path: CE and the forward
  KL (a liger beta of 0).

``chunked`` and ``fused_linear`` share the chunk machinery of :mod:`.chunks`; :mod:`.memory` counts what
each holds (:func:`~kdbench.distill.lm.impls.memory.logits_memory`).  Adding an implementation is one
module that calls :func:`~kdbench.distill.lm.impls.base.register_impl`, imported below.

Sources read: linkedin/Liger-Kernel 0.8.5 as installed (``chunked_loss/fused_linear_distillation.py``,
``chunked_loss/jsd_loss.py``, ``ops/fused_linear_jsd.py``; the same design at ead96b61 on GitHub);
pytorch/torchtune bd2a0fc7 ``torchtune/modules/loss/kd_losses.py``; torch 2.14
``F.linear_cross_entropy`` and ``torch.nn.LinearCrossEntropyOptions`` docstrings.
"""

from __future__ import annotations

import importlib

import torch

from kdbench.core.errors import KdbenchError
from kdbench.distill.lm.divergences import TokenLoss
from kdbench.distill.lm.impls.base import IMPLS, AlignedHeads, Heads, Settings, get_impl
from kdbench.distill.lm.impls.chunks import valid_rows

__all__ = [
    "LOSS_IMPLS",
    "computes",
    "impl_note",
    "lm_loss",
    "pad_unsupported",
    "uld_computers",
    "uld_lm_loss",
    "uld_unsupported",
    "unavailable",
    "unsupported",
]

for _module in ("dense", "natural", "chunked", "fused_linear", "liger", "torch_linear"):  # each registers itself
    importlib.import_module(f"{__name__}.{_module}")

LOSS_IMPLS = tuple(IMPLS)  # the names the config schema takes (``loss_impl``), in registration order


def unsupported(impl: str, loss: TokenLoss) -> str | None:
    """None when `impl` can compute `loss`, else the reason (names the impl and what to use instead).

    Pure logic, no optional import: usable at plan time.  ``dense``, ``natural``, ``chunked`` and
    ``fused_linear`` compute every registered divergence; ``liger`` those with a liger beta at the loss's parameters
    (forward KL, reverse KL, jsd; the skew KLs only at lam = 0); ``torch_linear`` CE and forward KL.
    """
    found = get_impl(impl)
    return found.unsupported(loss) if loss.has_kd else None


def computes(impl: str) -> list[str]:
    """The registered divergences `impl` computes (CE it always does): each by name, or at the parameter bound
    where it computes it alone (``skew_fkl at lam=0``); read from its ``unsupported``, nothing written twice."""
    from kdbench.distill.lm.divergences import DIVERGENCES

    found = get_impl(impl)
    out = []
    for name, div in DIVERGENCES.items():
        if found.unsupported(TokenLoss(name)) is None:
            out.append(name)
            continue
        for key, param in div.params.items():
            bounds = (param.low, param.high)
            at = next((v for v in bounds if found.unsupported(TokenLoss(name, **{key: v})) is None), None)
            if at is not None:
                out.append(f"{name} at {key}={at:g}")
                break
    return out


def impl_note(impl: str) -> str:
    """What a step row computed with `impl` must say of it ("" for nothing): a host-device sync it makes."""
    return get_impl(impl).note()


def unavailable(impl: str) -> str | None:
    """None when `impl` can run in this environment, else why and the fix (detected by feature)."""
    return get_impl(impl).unavailable()


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
    are constants.  `chunk_size` (tokens per chunk, >= 1) applies to every impl but ``dense`` and ``natural``.
    `rows`: the valid tokens' indices (:func:`~kdbench.distill.lm.impls.chunks.valid_rows`), when the caller
    found them once for a fixed batch; without them they are found here, which reads the labels back (a
    host-device sync on a GPU).  `liger_compiled` is liger's ``compiled`` (torch.compile of each chunk's step;
    liger's own default is True, off here: a compile costs seconds on first use, and needs a C++ compiler on
    the CPU).  The chunked, fused_linear and torch_linear impls compute gradients in forward and support one
    backward per forward (no retain_graph reuse, no double backward).
    """
    found = get_impl(impl)
    if not (loss.has_ce or loss.has_kd):
        raise KdbenchError("the LM loss has no term: set a divergence with kd_weight > 0, or ce_weight > 0")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise KdbenchError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    reason = unsupported(impl, loss)
    if reason is None:
        reason = found.unavailable()
    if reason is not None:
        raise KdbenchError(reason)
    hs, ht, lab = _flatten(student_hidden, student_weight, teacher_hidden, teacher_weight, labels)
    for name, bias, weight in (("student", student_bias, student_weight), ("teacher", teacher_bias, teacher_weight)):
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise KdbenchError(f"the {name} bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    teacher = [t.detach() if t is not None else None for t in (ht, teacher_weight, teacher_bias)]
    heads = Heads(hs, student_weight, student_bias, *teacher, lab)
    rows = valid_rows(lab) if rows is None else rows
    return found.compute(heads, loss, rows, Settings(chunk_size, liger_compiled))


def pad_unsupported(impl: str) -> str | None:
    """None when `impl` takes -inf logits (``data.vocab_policy: pad``: it leaves the infinite entries out, as
    :mod:`~kdbench.distill.lm.token_losses` defines), else the reason and what to use instead; plan time."""
    found = get_impl(impl)
    if not found.inf_why:
        return None
    takes = [name for name, other in IMPLS.items() if not other.inf_why]
    return (
        f"data.vocab_policy pad pads the smaller head with -inf logits, and loss_impl {impl} cannot take them "
        f"({found.inf_why}): use loss_impl {' or '.join(takes)}, or data.vocab_policy slice"
    )


def uld_computers() -> list[str]:
    """The implementations that compute ULD's term, in registration order."""
    return [name for name, found in IMPLS.items() if found.uld is not None]


def uld_unsupported(impl: str) -> str | None:
    """None when `impl` computes ULD's term (:mod:`kdbench.distill.lm.uld`), else the reason and what to use
    instead; pure logic, usable at plan time."""
    found = get_impl(impl)
    if found.uld is not None:
        return None
    return f"loss_impl {impl} cannot compute uld ({found.uld_why}): use loss_impl {' or '.join(uld_computers())}"


def uld_lm_loss(
    impl: str,
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    alignment,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """ULD's term (unweighted) of two LM heads, each over its own vocabulary, on the aligned rows of
    ``alignment`` (:func:`~kdbench.distill.lm.uld.uld_alignment`; flat indices into each side's (B·S) positions),
    computed by `impl`.  hidden: (B, S, H) or (N, H) per side, any S and H each.  A float32 scalar,
    differentiable w.r.t. the student's hidden states, weight and bias; the teacher's inputs are constants."""
    found = get_impl(impl)
    reason = uld_unsupported(impl) or found.unavailable()
    if reason is not None:
        raise KdbenchError(reason)
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach()
    teacher = [t.detach() if t is not None else None for t in (teacher_weight, teacher_bias)]
    heads = AlignedHeads(
        hs, student_weight, student_bias, ht, *teacher, alignment, student_temperature, teacher_temperature
    )
    return found.uld(heads, Settings(chunk_size))


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
