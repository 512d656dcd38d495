"""The offline teacher: its top-k next-token log-probabilities, stored once, and the sparse KL a student
trains against (DistillKit's and others' offline distillation).

For each token the cache keeps the k largest log-probabilities of the teacher at the cell's temperature
(float16) with their vocabulary indices (int16 where the vocabulary fits, else int32), and the log of the
mass of the rest (float32): ``k * (2 + 2 or 4) + 4`` bytes per token, against ``2 * V`` for the teacher's
fp16 logits (k = 128, V = 32,000: 516 bytes, 0.8 %).

The loss is the forward KL between two distributions over k + 1 buckets, the top-k entries and the rest:
p̂ = (p_1, ..., p_k, r) from the cache, and the student's q̂ = (q_{i_1}, ..., q_{i_k}, 1 − Σ q_{i_j}) from its
full softmax at T: ``Σ_j p_j (log p_j − log q_{i_j}) + r (log r − log q_rest)``, × T², mean over the valid
tokens.  With k = V (nothing in the rest) it is the dense forward KL.  How much the cache loses is the KL
between the teacher's dense distribution and the cache's reconstruction p̃ (the top-k entries, the rest's
mass spread evenly over the other V − k entries), measured once when the cache is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 1024  # tokens per chunk while the cache is built: no float32 copy of the whole logits


@dataclass
class TopKTeacher:
    """The cached teacher of one fixed batch: (B, S, k) log-probabilities and indices, (B, S) log rest-mass."""

    logp: torch.Tensor  # float16 log p_T of the top-k entries, at temperature T
    indices: torch.Tensor  # their vocabulary indices
    log_rest: torch.Tensor  # float32 log(1 − Σ top-k p_T); -inf when the top-k hold everything
    vocab: int
    temperature: float

    @property
    def k(self) -> int:
        return int(self.logp.shape[-1])

    @property
    def bytes_per_token(self) -> int:
        return self.k * (self.logp.element_size() + self.indices.element_size()) + self.log_rest.element_size()


def _log_rest(top: torch.Tensor) -> torch.Tensor:
    """log(1 − Σ exp(top)) from top-k log-probabilities (float32), -inf where they hold all the mass."""
    mass = torch.logsumexp(top, dim=-1)
    return torch.where(mass < 0, torch.log(-torch.expm1(mass.clamp(max=0))), torch.full_like(mass, -math.inf))


def topk_rows(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k of teacher ``logits`` (..., V) at ``temperature``, a chunk of tokens at a time, as (N, k) float32
    log-probabilities (descending), their (N, k) int64 indices and the (N,) float32 log rest-mass: what the
    in-memory cache (:func:`build_topk`) and an offline store (:mod:`kdbench.store.teacher_logits`) encode."""
    vocab = logits.shape[-1]
    k = min(k, vocab)
    flat = logits.reshape(-1, vocab)
    logp = torch.empty(flat.shape[0], k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(flat.shape[0], k, dtype=torch.long, device=logits.device)
    rest = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for start in range(0, flat.shape[0], CHUNK):
            log_p = F.log_softmax(flat[start : start + CHUNK].float() / temperature, dim=-1)
            top, idx = log_p.topk(k, dim=-1)
            logp[start : start + CHUNK] = top
            indices[start : start + CHUNK] = idx
            rest[start : start + CHUNK] = _log_rest(top)
    return logp, indices, rest


def build_topk(logits: torch.Tensor, k: int, temperature: float) -> TopKTeacher:
    """The top-k cache of teacher ``logits`` (B, S, V) at ``temperature`` (:func:`topk_rows`): float16
    log-probabilities, int16 indices where the vocabulary fits (else int32)."""
    vocab = logits.shape[-1]
    index_dtype = torch.int16 if vocab <= torch.iinfo(torch.int16).max + 1 else torch.int32
    logp, indices, rest = topk_rows(logits, k, temperature)
    k, shape = logp.shape[-1], logits.shape[:-1]
    return TopKTeacher(
        logp.to(torch.float16).reshape(*shape, k),
        indices.to(index_dtype).reshape(*shape, k),
        rest.reshape(shape),
        vocab,
        temperature,
    )


def topk_forward_kl(
    student: torch.Tensor, cache: TopKTeacher, mask: torch.Tensor | None = None, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The forward KL of the cache's k + 1 buckets against the student's (``student``: (B, S, V) logits), × T²,
    mean over the valid tokens (``mask``, like the logits without their last axis; or ``rows``, the flattened
    valid tokens' indices, which a GPU does not synchronise for); 0 with no valid token.  Its value and gradient
    in one pass each over the (N, V) logits (:class:`_SparseKL`)."""
    temperature = cache.temperature
    vocab = student.shape[-1]
    s = student.float().reshape(-1, vocab)
    logp = cache.logp.reshape(-1, cache.k).float()
    idx = cache.indices.reshape(-1, cache.k).long()
    rest = cache.log_rest.reshape(-1)
    if rows is not None:
        s, logp, idx, rest = (v.index_select(0, rows) for v in (s, logp, idx, rest))
    elif mask is not None:
        valid = mask.reshape(-1).to(device=s.device, dtype=torch.bool)
        s, logp, idx, rest = s[valid], logp[valid], idx[valid], rest[valid]
    return _SparseKL.apply(s, logp, idx, rest.float(), float(temperature), cache.k < vocab)


class _SparseKL(torch.autograd.Function):
    """The k + 1 bucket forward KL of (N, V) student logits ``s`` against the top-k (``logp``, ``idx``) and the rest
    (``rest``), × T², mean over the N rows, with its gradient written out.  With z = s / T, q = softmax(z), K the
    kept ids (a top-p cut's empty slots hold -inf and repeat a kept id), p_r the rest's mass, q_r = Σ_{j∉K} q_j and
    P = Σ p + p_r::

        dL/dz_j = q_j (P − p_r / q_r) + [j ∈ K] (q_j p_r / q_r − p_j)

    Autograd's version of the same loss (a log-softmax, its gather, a scatter of -inf and a logsumexp over the rest)
    took about ten (N, V) passes, the backward most of them (273 ms against a dense KL's 179 at N 512, V 32,000 on
    the 2-core VM); this one takes five: the row maximum, one exp, one sum, and the backward's one product.  q_r is
    the sum of the non-kept entries' exps, taken with the kept ones zeroed in place for the sum and put back (no
    cancellation, as exact as the logsumexp over them was; a float64 sum of the (N, V) exps would copy them to
    float64 inside its kernel, where no meter sees it)."""

    @staticmethod
    def forward(ctx, s, logp, idx, rest, temperature: float, has_rest_bucket: bool):
        n = s.shape[0]
        if n == 0:
            ctx.empty = True
            ctx.shape = s.shape
            return s.new_zeros(())
        ctx.empty = False
        top = s.amax(-1, keepdim=True)
        e = s - top  # (N, V): z - max z, then exp(z - max z), in place
        if temperature != 1.0:
            e.div_(temperature)
        e.exp_()
        kept = torch.isfinite(logp)
        if has_rest_bucket:  # the entries outside the kept ones summed apart: no cancellation, no copy of e
            e_top = e.gather(-1, idx)
            e.scatter_(-1, idx, 0.0)
            s_rest = e.sum(-1).double()
            e.scatter_(-1, idx, e_top)  # back as it was (an empty slot repeats a kept id with its own value)
            s_all = s_rest + torch.where(kept, e_top, 0.0).double().sum(-1)
        else:
            s_all = e.sum(-1).double()
        log_z = top.squeeze(-1).double() / temperature + torch.log(s_all)  # log Σ exp(z)
        log_q_top = s.gather(-1, idx).double() / temperature - log_z[:, None]
        p = logp.exp()
        total = torch.where(p > 0, p.double() * (logp.double() - log_q_top), 0.0).sum()
        if has_rest_bucket:  # the rest bucket: log q_rest = log Σ q over the entries outside the kept ones
            q_rest = s_rest / s_all
            has_rest = torch.isfinite(rest)
            p_rest = torch.where(has_rest, rest.double().exp(), 0.0)
            total = total + torch.where(has_rest, p_rest * (rest.double() - torch.log(q_rest)), 0.0).sum()
            ratio = torch.where(has_rest, p_rest / q_rest, 0.0)  # p_r / q_r
        else:
            p_rest = ratio = torch.zeros_like(s_all)
        mass = torch.where(p > 0, p, 0.0).double().sum(-1) + p_rest  # P
        ctx.save_for_backward(e, s_all, idx, kept, torch.where(p > 0, p, 0.0), mass, ratio)
        ctx.temperature = temperature
        return (total / n * temperature**2).float()

    @staticmethod
    def backward(ctx, grad):
        if ctx.empty:
            return grad.new_zeros(ctx.shape), None, None, None, None, None
        e, s_all, idx, kept, p, mass, ratio = ctx.saved_tensors
        n, temperature = e.shape[0], ctx.temperature
        scale = grad.double() * temperature / n  # × T² / N, and dz/ds = 1 / T
        coef = ((mass - ratio) / s_all * scale).float()  # q_j = e_j / s_all
        out = e * coef[:, None]
        q_kept = e.gather(-1, idx).double() / s_all[:, None]
        fix = torch.where(kept, (q_kept * ratio[:, None] - p.double()) * scale, 0.0).float()
        out.scatter_add_(-1, idx, fix)
        return out, None, None, None, None, None


def reconstruction_kl(logits: torch.Tensor, cache: TopKTeacher, mask: torch.Tensor | None = None) -> float:
    """KL(p_T ‖ p̃) in nats, mean over the valid tokens: what the cache loses of the teacher's distribution,
    p̃ being the cached top-k entries with the rest's mass spread evenly over the other V − k entries."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    logp = cache.logp.reshape(-1, cache.k).float()
    idx = cache.indices.reshape(-1, cache.k).long()
    rest = cache.log_rest.reshape(-1)
    keep = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    if mask is not None:
        keep = mask.reshape(-1).to(device=flat.device, dtype=torch.bool)
    others = vocab - cache.k
    cut = bool((~torch.isfinite(logp)).any())
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, flat.shape[0], CHUNK):
            rows = keep[start : start + CHUNK]
            if not rows.any():
                continue
            log_p = F.log_softmax(flat[start : start + CHUNK][rows].float() / cache.temperature, dim=-1)
            kept = logp[start : start + CHUNK][rows]
            if cut:  # a top-p cut: each row's rest spread over the entries it did not keep
                left = (vocab - torch.isfinite(kept).sum(-1)).double()
                spread = rest[start : start + CHUNK][rows] - torch.where(left > 0, left.log(), 0.0).float()
            else:
                spread = rest[start : start + CHUNK][rows] - (math.log(others) if others else 0.0)
            log_tilde = spread[:, None].expand_as(log_p).clone()
            # amax: a cut's empty slots repeat a kept id with -inf, which must not overwrite it
            log_tilde.scatter_reduce_(-1, idx[start : start + CHUNK][rows], kept, "amax", include_self=False)
            p = log_p.exp()
            total += float(torch.where(p > 0, p * (log_p - log_tilde), 0.0).sum())
            count += int(rows.sum())
    return total / max(count, 1)
