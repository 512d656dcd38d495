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
    valid tokens' indices, which a GPU does not synchronise for); 0 with no valid token."""
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
    log_q = F.log_softmax(s / temperature, dim=-1)
    log_q_top = log_q.gather(-1, idx)
    p = logp.exp()  # 0 at a slot a top-p cut left empty (-inf): it adds nothing
    total = torch.where(p > 0, p * (logp - log_q_top), 0.0).sum()
    if cache.k < vocab:  # the rest bucket: log q_rest = log Σ q over the entries outside the top-k
        log_q_rest = torch.logsumexp(log_q.scatter(-1, idx, -math.inf), dim=-1)
        has_rest = torch.isfinite(rest)
        safe = torch.where(has_rest, rest, 0.0)
        total = total + torch.where(has_rest, safe.exp() * (safe - log_q_rest), 0.0).sum()
    return total / max(s.shape[0], 1) * temperature**2


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
