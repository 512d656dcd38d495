"""The accuracy ledger: how far a loss implementation's loss and gradients, at the cell's precision, lie from a
float64 evaluation of the same objective; and the objective itself, in words.

:func:`loss_ledger` runs the token loss twice on the same inputs: once as the cell runs it (its ``loss_impl``, the
hidden states and heads in the cell's dtypes), once as the reference (``dense``, every input upcast to float64,
everything after in float64: :func:`kdbench.distill.lm.token_losses.upcast` keeps float64).  It returns

* ``loss_rel_err`` = |L − L64| / |L64|;
* ``grad_rel_err`` = ‖g − g64‖₂ / ‖g64‖₂, g the student's gradients (w.r.t. its final hidden states and its LM
  head's weight, and bias where it has one) flattened and concatenated, the Euclidean norm over all their entries;
  ``grad_rel_err_hidden`` and ``grad_rel_err_head`` the same over each part alone.

At most the batch's first :data:`LEDGER_TOKENS` counted tokens are evaluated (:func:`ledger_tokens`), so that the
float64 reference fits beside the models at any vocabulary.  A reference of 0 (a loss or a gradient that is exactly
0 in float64) has no relative error: the column is None and :func:`loss_ledger` says why in its notes; a reference
that is not exactly 0 keeps its relative error, however small the reference (the KL of two equal distributions
rounds to about 1e-17, and its relative error is then large: read it with the objective).  The ledger is a
diagnostic, taken once per cell outside every timed figure (:meth:`kdbench.distill.lm.loss.LMLoss.ledger`); it
reads values back (host syncs).

:func:`objective_text` says what a cell's token loss computes, in words (``0.5·CE + 0.5·forward_kl(T=2, ×T²) over
32000 shared entries``): one function, so a row's ``loss_objective`` and every other mention say the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kdbench.distill.lm.divergences import TokenLoss, get_divergence
from kdbench.distill.lm.impls.chunks import valid_rows

__all__ = ["LEDGER_COLUMNS", "LEDGER_TOKENS", "ledger_tokens", "loss_ledger", "objective_text", "rel_err"]

LEDGER_COLUMNS = ("loss_rel_err", "grad_rel_err", "grad_rel_err_hidden", "grad_rel_err_head")
# The counted tokens the ledger evaluates at most (the batch's first ones): float64 dense holds about six
# (tokens, V) float64 buffers, 1.6 GB at a 32k vocabulary and 6 GB at 128k with this many, beside both heads upcast
# to float64 and the student head's float64 gradient (4.2 + 2.1 + 2.1 GB for Llama-3.1-8B -> 3.2-1B: ~15 GB in all)
LEDGER_TOKENS = 1024

Inputs = Sequence[torch.Tensor | None]  # student hidden, weight, bias, teacher hidden, weight, bias


def rel_err(value: torch.Tensor, reference: torch.Tensor) -> float | None:
    """‖value − reference‖₂ / ‖reference‖₂ in float64 (for scalars: |x − r| / |r|); None where the reference is 0."""
    ref = reference.detach().double()
    den = torch.linalg.vector_norm(ref).item()
    if den == 0.0 or not math.isfinite(den):
        return None
    return torch.linalg.vector_norm(value.detach().double() - ref).item() / den


def _value_grads(impl: str, inputs: Inputs, labels, token: TokenLoss, chunk_size: int, rows, objective=None) -> tuple:
    """The loss computed by ``impl`` and its gradients w.r.t. the student's hidden states, weight (and bias);
    ``objective(impl, *inputs)``: the loss where it is not ``lm_loss`` of ``token`` (ULD's)."""
    hs, ws, bs, ht, wt, bt = (None if t is None else t.detach() for t in inputs)
    leaves = [t.requires_grad_(True) for t in (hs, ws, bs) if t is not None]
    from kdbench.distill.lm.impls import lm_loss

    with torch.enable_grad():
        if objective is not None:
            loss = objective(impl, hs, ws, bs, ht, wt, bt)
        else:
            loss = lm_loss(impl, hs, ws, bs, ht, wt, bt, labels, token, chunk_size=chunk_size, rows=rows)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
    return loss.detach(), grads


def ledger_tokens(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, labels: torch.Tensor, most=None):
    """The batch cut to its first ``most`` (:data:`LEDGER_TOKENS`) counted tokens, flattened: (N, H) hidden states,
    (N,) labels and the counted rows' indices (the positions up to the last kept counted one; all where fewer)."""
    most = LEDGER_TOKENS if most is None else most
    hs, ht = student_hidden.reshape(-1, student_hidden.shape[-1]), teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    labels = labels.reshape(-1)
    rows = valid_rows(labels)
    if rows.numel() > most:
        end = int(rows[most - 1]) + 1
        hs, ht, labels, rows = hs[:end], ht[:end], labels[:end], rows[:most]
    return hs, ht, labels, rows


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def loss_ledger(
    impl: str,
    cell: Inputs,
    reference: Inputs,
    labels: torch.Tensor,
    token: TokenLoss,
    chunk_size: int,
    rows: torch.Tensor | None = None,
    objective=None,
) -> tuple[dict[str, float | None], list[str]]:
    """The ledger's columns (:data:`LEDGER_COLUMNS`) and its notes (why a column is None).

    ``cell``: the loss inputs as the cell hands them to ``impl`` (student hidden states, head weight, bias; the
    teacher's), in the cell's dtypes; ``reference``: the same in float64 (the models' float32 heads upcast, not
    their 16-bit copies).  ``labels``: (N,) or (B, S), -100 = not counted; ``rows``: their valid indices.
    ``objective(impl, *inputs)``: the loss, where it is not the token loss ``token`` computed by ``lm_loss`` (ULD's:
    :meth:`kdbench.distill.lm.loss.LMLoss.ledger`)."""
    loss, grads = _value_grads(impl, cell, labels, token, chunk_size, rows, objective)
    ref = [None if t is None else t.double() for t in reference]
    loss64, grads64 = _value_grads("dense", ref, labels, token, chunk_size, rows, objective)
    row = {
        "loss_rel_err": rel_err(loss, loss64),
        "grad_rel_err": rel_err(_flat(grads), _flat(grads64)),
        "grad_rel_err_hidden": rel_err(grads[0], grads64[0]),
        "grad_rel_err_head": rel_err(_flat(grads[1:]), _flat(grads64[1:])),
    }
    zero = [name for name, value in row.items() if value is None]
    notes = [f"accuracy ledger: the float64 reference of {', '.join(zero)} is 0: no relative error"] if zero else []
    return row, notes


def _weight(w: float) -> str:
    return f"{w:g}·" if w != 1.0 else ""


def objective_text(
    token: TokenLoss,
    vocab: int | None = None,
    vocabs: tuple[int | None, int | None] = (None, None),
    features: Sequence[tuple[float, str]] = (),
    topk: int | None = None,
    policy: str = "slice",
    uld: Sequence[tuple[float, float]] = (),
    uld_alignment: str = "position",
) -> str:
    """What a token loss computes, in words: ``0.5·CE + 0.5·forward_kl(T=2, ×T²) over 32000 shared entries
    (vocab_policy slice of 32000/50257)``.  ``vocab``: the entries both heads are cut to; ``vocabs``: the teacher's
    and the student's own sizes (said when they differ); ``features``: the feature terms (weight, name) added;
    ``topk``: the teacher's top-k cache (the sparse forward KL over its k entries); ``policy``: the vocab_policy
    that reconciles two sizes (slice: both cut to ``vocab``; pad: the smaller padded with -inf up to ``vocab``);
    ``uld``: the ULD terms (weight, temperature), each head over its own vocabulary (``vocabs``), their rows paired
    by ``uld_alignment`` (position after the prompt, or bytes: by the text read)."""
    parts = []
    if token.has_ce:
        parts.append(f"{_weight(token.ce_weight)}CE")
    if token.has_kd:
        div = get_divergence(token.divergence)
        args = [f"{k}={v:g}" for k, v in token.params]
        scale = "×T²" if token.temperature != 1.0 else ""
        args.append(f"T={token.temperature:g}" + (f", {scale}" if scale else ""))
        name = div.name if topk is None else f"{div.name} over the teacher's top-{topk} log-probs"
        parts.append(f"{_weight(token.kd_weight)}{name}({', '.join(args)})")
    for weight, temp in uld:
        paired = "positions paired " + ("after the prompt" if uld_alignment == "position" else "by bytes read")
        parts.append(f"{_weight(weight)}uld(T={temp:g}, sorted probabilities, L1, {paired})")
    text = " + ".join(parts) or "0"
    if uld:
        teacher_v, student_v = vocabs
        if teacher_v is not None and student_v is not None:
            text += f" over each side's own entries ({teacher_v} teacher / {student_v} student)"
    elif vocab is not None:
        text += f" over {vocab} shared entries" if len(set(vocabs) - {None}) > 1 else f" over {vocab} entries"
        teacher_v, student_v = vocabs
        if teacher_v is not None and student_v is not None and teacher_v != student_v:
            if policy == "pad":
                text = text.replace(" shared entries", " entries")
                text += (
                    f" (vocab_policy pad: the smaller of {teacher_v} teacher / {student_v} student padded with -inf)"
                )
            else:
                text += f" (vocab_policy slice of {teacher_v} teacher / {student_v} student)"
    for weight, name in features:
        text += f" + {_weight(weight)}{name}"
    return text
