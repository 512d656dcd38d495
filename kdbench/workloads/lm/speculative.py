"""Speculative decoding: a target LM (the teacher) generating with a draft LM (a student) that proposes tokens.

Each round the draft proposes ``draft_tokens`` (γ) tokens autoregressively on its own KV cache; the target scores
the last committed token and all γ proposals in ONE forward on its KV cache (the verify step) and accepts a prefix
of them, then adds one token of its own (the correction at the first rejection, or the bonus token after γ
acceptances).  Both caches are cut back to the committed sequence, so the next round continues from it.

* **Greedy** (``temperature == 0``): a proposal is accepted when it is the target's argmax at its position; the
  correction or bonus is the target's argmax.  The output is the target's own greedy decoding, token for token
  (up to ties that the verify forward's other kernel shapes could order differently).
* **Sampled** (``temperature > 0``): the rejection scheme of Leviathan et al. 2023 (Algorithm 1) and Chen et al.
  2023: with p and q the target's and draft's softmax(logits / T) at the position, a proposal x ~ q is accepted
  with probability min(1, p(x) / q(x)); at the first rejection the correction is sampled from
  norm(max(0, p - q)); after γ acceptances the bonus is sampled from p.  The output is distributed as the target's
  own sampling.

Counts, per call: ``proposed`` draft tokens, ``accepted`` of them, ``rejected`` (verify steps that ended in a
rejection: at most one each), ``verifies`` (target forwards after the prefill).  The acceptance rate α =
accepted / (accepted + rejected): the share of the proposals the target judged that it accepted (proposals after
a rejection are never judged).  For sampled verification its expectation is E[1 - TV(p, q)] (Leviathan et al.,
Corollary 3.6), the divergence family a distilled draft is trained on.

Batch size 1 (as transformers' assisted generation): sequences of a batch accept different numbers of tokens, and
their caches would part ways.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kdbench.core.speculation import expected_tokens_per_verify, predicted_speedup

__all__ = [
    "Speculation",
    "expected_tokens_per_verify",
    "greedy_generate",
    "predicted_speedup",
    "speculative_generate",
    "total_variation",
]


def _keyword(forward, *names: str) -> str | None:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    return next((n for n in names if n in params), None)


class _Cached:
    """One LM's forward on its KV cache: ``feed(ids)`` appends ``ids`` (1, k) to the cache and returns their
    logits (1, k, V) in float32; ``cut(length)`` crops the cache back to ``length`` tokens."""

    def __init__(self, lm: nn.Module, vocab: int | None, cache: Any = None):
        self.lm, self.vocab = lm, vocab
        self.cache_kw = _keyword(lm.forward, "cache", "past_key_values") or "past_key_values"
        self.cache = cache
        self.length = 0 if cache is None else int(cache.get_seq_length())

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        kwargs = {self.cache_kw: self.cache} if self.cache is not None else {}
        out = self.lm(input_ids=ids, use_cache=True, **kwargs)
        self.cache = getattr(out, "cache", None) or out.past_key_values
        self.length += ids.shape[1]
        return out.logits[..., : self.vocab].float()

    def cut(self, length: int) -> None:
        """Crop to ``length`` tokens.  A negative count of tokens to remove: what every transformers version's
        ``crop`` takes (4.x took a length or a negative count; 5.x a negative count only); never ``crop(0)``, which
        4.x read as a length of 0."""
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)
            self.length = length


@dataclass
class Speculation:
    """One speculative generation: the tokens and what the verification made of the draft's proposals."""

    tokens: torch.Tensor  # (1, P + new_tokens): the prompt and the generated tokens
    new_tokens: int
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of them accepted
    rejected: int = 0  # verify steps that ended in a rejection
    verifies: int = 0  # target forwards after the prefill (one per round)
    draft_forwards: int = 0  # draft forwards after its prefill

    @property
    def alpha(self) -> float | None:
        """Acceptance rate: accepted / judged proposals (None when nothing was judged)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else None

    @property
    def tokens_per_verify(self) -> float | None:
        """Tokens generated per target verify step (accepted proposals + the target's own token)."""
        return self.new_tokens / self.verifies if self.verifies else None

    @property
    def accepted_per_verify(self) -> float | None:
        return self.accepted / self.verifies if self.verifies else None


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1)


def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    draft_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    vocab: int | None = None,
    caches: tuple[Any, Any] | None = None,
) -> Speculation:
    """``prompt`` (1, P), P >= 1, followed by ``new_tokens`` tokens of ``target`` (a transformers causal LM) with
    ``draft`` proposing ``draft_tokens`` per round (see the module's docstring); ``vocab``: the first entries of
    both models' logits that count (None: all; they must then be the same size).  Call it under
    ``torch.inference_mode()`` with both models in eval mode; sampling draws from ``generator`` (on the prompt's
    device).

    ``caches``: the target's and the draft's KV caches already holding the prompt but its last token
    (:func:`prefill`, e.g. done once before a timed loop); the call continues from them, as it would from its own
    prefill (same tokens, same counts), and cuts both back to those P - 1 tokens before it returns, so that every
    call starts from the same state.  None: the call prefills its own."""
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] < 1:
        raise ValueError(f"speculative decoding takes one prompt of at least one token, shape (1, P): {prompt.shape}")
    if draft_tokens < 1 or new_tokens < 1:
        raise ValueError(f"draft_tokens ({draft_tokens}) and new_tokens ({new_tokens}) must be at least 1")
    greedy = temperature == 0
    if caches is not None:
        t, d = _Cached(target, vocab, caches[0]), _Cached(draft, vocab, caches[1])
        held = prompt.shape[1] - 1
        if t.length != held or d.length != held:
            why = f"the caches hold {t.length} and {d.length} tokens, not the prompt but its last ({held})"
            raise ValueError(why)
        try:
            return _rounds(t, d, prompt, new_tokens, draft_tokens, temperature, greedy, generator)
        finally:  # back to the prompt: the next call starts from the same state
            t.cut(prompt.shape[1] - 1)
            d.cut(prompt.shape[1] - 1)
    t, d = _Cached(target, vocab), _Cached(draft, vocab)
    if prompt.shape[1] > 1:  # both caches hold the prompt but its last token, which the first round feeds
        t.feed(prompt[:, :-1])
        d.feed(prompt[:, :-1])
    return _rounds(t, d, prompt, new_tokens, draft_tokens, temperature, greedy, generator)


def prefill(lm: nn.Module, prompt: torch.Tensor) -> Any:
    """``lm``'s KV cache holding ``prompt`` (1, P) but its last token: the state :func:`speculative_generate` starts
    from (``caches``).  A one-token prompt: an empty cache of the model's kind (transformers' DynamicCache)."""
    if prompt.shape[1] > 1:
        cached = _Cached(lm, None)
        cached.feed(prompt[:, :-1])
        return cached.cache
    from transformers import DynamicCache

    try:
        return DynamicCache(config=lm.config)  # transformers >= 4.56 builds its layers from the config
    except TypeError:
        return DynamicCache()


def _rounds(
    t: _Cached,
    d: _Cached,
    prompt: torch.Tensor,
    new_tokens: int,
    draft_tokens: int,
    temperature: float,
    greedy: bool,
    generator: torch.Generator | None,
) -> Speculation:
    """The rounds of :func:`speculative_generate` from caches ``t`` and ``d`` that hold the prompt but its last
    token."""
    ids = prompt
    out = Speculation(prompt, new_tokens)
    while ids.shape[1] - prompt.shape[1] < new_tokens:
        gamma = min(draft_tokens, new_tokens - (ids.shape[1] - prompt.shape[1]))
        # the draft proposes: first it catches up on committed tokens it has not seen (the last, and after a
        # round that accepted everything, the last proposal too)
        logits = d.feed(ids[:, d.length :])[:, -1]
        proposals, qs = [], []
        for i in range(gamma):
            if greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                q = _probs(logits, temperature)
                qs.append(q)
                token = torch.multinomial(q, 1, generator=generator)
            proposals.append(token)
            if i + 1 < gamma:
                logits = d.feed(token)[:, -1]
        out.draft_forwards += gamma
        drafted = torch.cat(proposals, dim=1)  # (1, gamma)
        # the target verifies: its logits at the last committed token and at each proposal, in one forward
        scores = t.feed(torch.cat([ids[:, t.length :], drafted], dim=1))[:, -(gamma + 1) :]  # (1, gamma + 1, V)
        out.verifies += 1
        out.proposed += gamma
        if greedy:
            best = scores.argmax(-1)  # (1, gamma + 1)
            agree = (best[:, :gamma] == drafted)[0].tolist()
            k = next((i for i, ok in enumerate(agree) if not ok), gamma)
            extra = best[:, k : k + 1]
        else:
            p = _probs(scores[0], temperature)  # (gamma + 1, V)
            q = torch.cat(qs, dim=0)  # (gamma, V)
            idx = drafted[0]
            p_x = p[torch.arange(gamma, device=p.device), idx]
            q_x = q[torch.arange(gamma, device=q.device), idx]
            u = torch.rand(gamma, generator=generator, device=p.device)
            ok = (u * q_x <= p_x).tolist()  # u < p/q without a division by a q of 0 (x was drawn from q: q > 0)
            k = next((i for i, a in enumerate(ok) if not a), gamma)
            if k < gamma:
                residual = torch.clamp(p[k] - q[k], min=0)
                total = float(residual.sum())
                # p == q at this position (to rounding): the rejection had probability ~0; p itself is the target
                dist = residual / total if total > 0 and math.isfinite(total) else p[k]
            else:
                dist = p[gamma]
            extra = torch.multinomial(dist.unsqueeze(0), 1, generator=generator)
        out.accepted += k
        out.rejected += int(k < gamma)
        committed = ids.shape[1]
        ids = torch.cat([ids, drafted[:, :k], extra], dim=1)
        # caches back to the committed sequence but its last token (which the next round feeds)
        t.cut(committed + k)
        d.cut(min(d.length, committed + k))
    out.tokens = ids[:, : prompt.shape[1] + new_tokens]
    return out


def greedy_generate(lm: nn.Module, prompt: torch.Tensor, new_tokens: int, vocab: int | None = None) -> torch.Tensor:
    """``prompt`` (B, P) followed by ``new_tokens`` greedy tokens of ``lm`` on its KV cache: (B, P + new_tokens).
    The reference speculative greedy output is held to, and the target-alone baseline a speculative row is timed
    against."""
    model = _Cached(lm, vocab)
    logits = model.feed(prompt)[:, -1]
    tokens = [prompt]
    for i in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        if i + 1 < new_tokens:
            logits = model.feed(token)[:, -1]
    return torch.cat(tokens, dim=1)


def total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """TV(p, q) = ½ Σ |p - q| per position of two models' logits (…, V) at ``temperature``; 1 - TV is the
    probability a sampled proposal from q is accepted at that position (Leviathan et al., Lemma 3.3)."""
    p = _probs(p_logits.float(), temperature)
    q = _probs(q_logits.float(), temperature)
    return 0.5 * (p - q).abs().sum(-1)


# --------------------------------------------------------------------------- the cell's speculative_decode rows

SAMPLED_AGAINST_GREEDY = (
    "sampled verification (temperature {t:g}) against the teacher's greedy decode row: spec_speedup compares this "
    "row with an argmax per token; sampling adds a softmax and a draw per position to this row's work"
)


def planned_speculative(config: Any) -> list[tuple[Any, int]]:
    """The cell's speculative_decode measurements (``inference.speculative``): one per draft length and temperature
    (draft-length-major), each at batch size 1, as :class:`~kdbench.core.names.Speculative` (the measurement carrying
    its variant)."""
    from kdbench.core.names import Speculative

    spec = config.inference.speculative
    if spec is None:
        return []
    return [(Speculative(g, t), 1) for g in spec.draft_tokens for t in spec.temperature]


def measure_speculative(
    workload: Any, measurement: Any, pair: tuple, batch_size: int, config: Any, backend: Any, budget_s: float | None
) -> Any:
    """The speculative_decode row of ``measurement`` (a :class:`~kdbench.core.names.Speculative`: its draft length and
    temperature): the teacher (``pair[0]``) generating ``inference.decode_tokens`` new tokens after the cell's
    batch-size-1 prompt (the decode rows' first prompt) with the student (``pair[1]``) as its draft, timed within
    ``budget_s``.  Both models eval, under inference mode and the cell's precision; both prompts prefilled before
    the timed loop (untimed) and their caches cut back to them after each call; a sampled call draws from a
    generator seeded the same at its start (every call does the same work).  The row holds the counts of the last
    call (every call's are the same)."""
    from kdbench.core.names import Measurement, variant_columns
    from kdbench.hw.backends import choose_autocast
    from kdbench.measure.failures import SkipMeasurement
    from kdbench.workloads.lm.serving import token_serving_row
    from kdbench.workloads.lm.workload import shared_vocab

    if batch_size != 1:
        raise SkipMeasurement(f"speculative decoding runs at batch size 1, not {batch_size}")
    teacher, student = pair
    if not (getattr(teacher, "hf", False) and getattr(student, "hf", False)):
        why = "speculative decoding needs two transformers causal LMs (a KV cache each); this pair's return logits"
        raise SkipMeasurement(why)
    variant = variant_columns(measurement)
    gamma, temperature = variant["draft_tokens"], variant["spec_temperature"]
    new_tokens = config.inference.decode_tokens
    ids, _ = workload.batch(config, 1, backend.device, config.seed + 1, pair)  # the decode rows' first prompt
    vocab = shared_vocab(config, teacher, student)
    sizes = {teacher.vocab_size, student.vocab_size}
    target, draft = teacher.lm, student.lm
    target.eval()
    draft.eval()
    choice = choose_autocast(backend, config.precision)
    seed = config.seed + 2
    generator = torch.Generator(device=backend.device) if temperature > 0 else None
    state: dict[str, Any] = {}

    def start() -> None:  # both prompts in their caches (untimed; called under inference mode and the precision)
        state["caches"] = (prefill(target, ids), prefill(draft, ids))

    def call() -> Speculation:
        if generator is not None:
            generator.manual_seed(seed)  # the same draws every call: the same work
        with torch.inference_mode(), choice.context(backend.device_type):
            out = speculative_generate(
                target, draft, ids, new_tokens, gamma, temperature, generator, vocab, caches=state["caches"]
            )
        state["last"] = out
        return out

    notes: tuple[str, ...] = ()
    if temperature > 0:
        notes += (SAMPLED_AGAINST_GREEDY.format(t=temperature),)
    if len(sizes - {None}) > 1:
        notes += (f"the vocabularies differ: both models draft and verify over the {vocab} entries they share",)
    columns = {"decode_tokens": new_tokens, **variant}
    measured = Measurement.SPECULATIVE_DECODE
    args = (workload, measured, 1, config, backend, budget_s, choice, call, ids, columns, notes)
    row = token_serving_row(*args, start=start)
    last: Speculation | None = state.get("last")
    if last is not None:
        row.update(
            spec_alpha=last.alpha,
            spec_accepted_per_verify=last.accepted_per_verify,
            spec_tokens_per_verify=last.tokens_per_verify,
            decode_bytes_per_token=speculative_bytes_per_token(target, draft, choice, ids.shape[1], last),
        )
    return row


def speculative_bytes_per_token(target: nn.Module, draft: nn.Module, choice: Any, prompt_len: int, run: Speculation):
    """The bytes a speculative generation must read per generated token (its memory-bandwidth floor, as
    :mod:`kdbench.measure.decode_floor` counts a decode step's): each verify step reads the target's weights and KV
    cache once, each draft forward the draft's, over the ``run``'s counts: ``(verifies × target_bytes +
    draft_forwards × draft_bytes) / new_tokens``, each model's bytes per step those of a batch-1 decode over the
    same span (:func:`~kdbench.measure.decode_floor.model_decode_bytes_per_token`).  None where a config does not
    give its layer and head numbers."""
    from kdbench.measure.decode_floor import model_decode_bytes_per_token
    from kdbench.workloads.lm.serving import cache_dtype

    try:
        per_step = [
            model_decode_bytes_per_token(
                lm, torch.empty((), dtype=cache_dtype(lm, choice)).element_size(), 1, prompt_len, run.new_tokens
            )
            for lm in (target, draft)
        ]
    except (AttributeError, TypeError, ValueError):
        return None
    return (run.verifies * per_step[0] + run.draft_forwards * per_step[1]) / run.new_tokens


def sampled_generate(
    lm: nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    temperature: float,
    generator: torch.Generator | None = None,
    vocab: int | None = None,
) -> torch.Tensor:
    """``prompt`` (B, P) followed by ``new_tokens`` tokens of ``lm`` alone on its KV cache, each sampled from
    softmax(logits / ``temperature``) (multinomial, drawing from ``generator``) as :func:`speculative_generate`
    samples; greedy (:func:`greedy_generate`) at ``temperature`` 0.  The baseline a sampled speculative
    generation is timed against: the same sampling work per token, one forward per token."""
    if temperature == 0:
        return greedy_generate(lm, prompt, new_tokens, vocab)
    model = _Cached(lm, vocab)
    logits = model.feed(prompt)[:, -1]
    tokens = [prompt]
    for i in range(new_tokens):
        token = torch.multinomial(_probs(logits, temperature), 1, generator=generator)
        tokens.append(token)
        if i + 1 < new_tokens:
            logits = model.feed(token)[:, -1]
    return torch.cat(tokens, dim=1)
