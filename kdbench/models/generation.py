"""Generation with a KV cache, written once: the decode loop, its token picker, the cached model it steps, and the
transformers-version shims, for every caller (the decode rows and the on-policy phase of
:mod:`kdbench.workloads.lm`, speculative decoding's rows and the quality drafts of :mod:`kdbench.quality.drafts`).

:func:`decode` is the package's one decode loop: from a token, each step feeds the last token to the model on its
cache (:meth:`Cached.advance`) and a :class:`Picker` picks the next from the logits (argmax, or drawn from
softmax(logits / T) with a generator).  The callers differ only in the model side:

* greedy serving (:class:`GreedyServing`): a prefill done before a timed loop, then each decode call from the same
  state (the cache cut back to the prompt after each call);
* sampling (:func:`sample`, GKD's on-policy completions) and the plain generations (:func:`greedy_generate`,
  :func:`sampled_generate`: the reference and the target-alone baseline of speculative decoding);
* speculative decoding (:func:`speculative_generate`): the draft proposes γ tokens a round by the same loop, the
  target verifies them in one forward, and both caches are cut back to the committed tokens.

Generation backends (a cell's ``generation``): ``cache: dynamic`` is transformers' growing cache; ``cache: static``
preallocates ``StaticCache`` (:func:`static_cache`) of prompt + new tokens positions: on transformers 5 (whose
static layers crop by a negative count) it is cropped back to the prompt after each call; on 4.x, whose forward
takes ``cache_position``, each step is given its position, so each call overwrites the slots it wrote before and
the causal mask hides the rest.  ``compile: true`` (static only) runs each decode step through ``torch.compile``
(:func:`decode_step`); the prefill stays eager.

Speculative decoding.  Each round the draft proposes ``draft_tokens`` (γ) tokens on its own KV cache; the target
scores the last committed token and the γ proposals in ONE forward and accepts a prefix of them, then adds one
token of its own (the correction at the first rejection, or the bonus after γ acceptances).  Greedy (T = 0): a
proposal is accepted when it is the target's argmax; the output is the target's own greedy decoding.  Sampled
(T > 0): Leviathan et al. 2023 (Algorithm 1) and Chen et al. 2023: x ~ q accepted with probability min(1, p(x) /
q(x)), the correction drawn from norm(max(0, p - q)), the bonus from p; the output is distributed as the target's
own sampling.  Counts per call: ``proposed``, ``accepted``, ``rejected`` (verify steps that ended in a rejection),
``verifies``; α = accepted / (accepted + rejected), whose expectation under sampling is E[1 - TV(p, q)]
(:mod:`kdbench.core.speculation`).  Batch size 1 (as transformers' assisted generation).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# --------------------------------------------------------------------------- transformers shims


def _keyword(forward, *names: str) -> str | None:
    """The first of ``names`` the model's forward takes (transformers renamed several across versions)."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    return next((n for n in names if n in params), None)


def static_cache(lm: nn.Module, batch_size: int, max_len: int, dtype: torch.dtype, device: Any) -> Any:
    """transformers' ``StaticCache`` of ``max_len`` positions for ``lm``: the constructor's keywords found by its
    signature (transformers 5 takes the config and the length and allocates on first use; 4.x also takes the
    batch size (``batch_size`` or ``max_batch_size``), the device and the dtype)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = {"config": lm.config, "max_cache_len": max_len}
    size = next((k for k in ("max_batch_size", "batch_size") if k in params), None)
    if size:
        kwargs[size] = batch_size
    kwargs.update({k: v for k, v in (("device", device), ("dtype", dtype)) if k in params})
    return StaticCache(**kwargs)


def cache_dtype(lm: nn.Module, choice: Any) -> torch.dtype:
    """The dtype of ``lm``'s K and V under the precision ``choice``: autocast's, else its parameters'."""
    if choice is not None and choice.applied:
        return choice.dtype
    return next(lm.parameters()).dtype


def decode_step(lm: nn.Module, generation: Any, device_type: str, store: dict) -> Callable[..., Any]:
    """What runs one decode step of ``lm``: its eager forward, or with ``generation.compile`` its forward through
    ``torch.compile`` (``fullgraph=True``, static shapes; ``reduce-overhead`` on GPUs as transformers documents
    for a static cache, ``default`` on the CPU, where CUDA graphs do not exist), made once per model and kept in
    ``store``, the measurement's own dict (dropped with it); the first compile into an empty store resets
    ``torch._dynamo``, so that an earlier measurement's compiled decode does not make this one look free."""
    if generation is None or not generation.compile:
        return lm
    key = ("compiled", id(lm))
    if key not in store or store[key][0] is not lm:
        if not any(k[0] == "compiled" for k in store):
            torch._dynamo.reset()
        mode = "reduce-overhead" if device_type == "cuda" else None
        store[key] = (lm, torch.compile(lm.forward, mode=mode, fullgraph=True, dynamic=False))
    return store[key][1]


def release(store: dict) -> bool:
    """Let go of what a measurement's ``store`` holds (compiled decode steps, static caches); whether it compiled
    (then the caller lets go of torch._dynamo's compiled code too: :func:`kdbench.measure.levers.release_compiled`)."""
    compiled = any(k[0] == "compiled" for k in store)
    store.clear()
    return compiled


def is_static(generation: Any) -> bool:
    return generation is not None and generation.cache == "static"


# --------------------------------------------------------------------------- the loop


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) over the last axis."""
    return torch.softmax(logits / temperature, dim=-1)


@dataclass
class Picker:
    """How the next token is picked from a position's logits (B, V): the argmax at ``temperature`` 0, else drawn
    (multinomial, from ``generator``) from softmax(logits / temperature), over the first ``vocab`` entries (None:
    all); ``kept``: a list the distributions drawn from are appended to (the speculative draft's q)."""

    temperature: float = 0.0
    generator: torch.Generator | None = None
    vocab: int | None = None
    kept: list[torch.Tensor] | None = field(default=None, repr=False)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[..., : self.vocab]
        if self.temperature == 0:
            return logits.argmax(-1, keepdim=True)
        probs = probabilities(logits.float(), self.temperature)
        if self.kept is not None:
            self.kept.append(probs)
        return torch.multinomial(probs, 1, generator=self.generator)


def decode(
    step: Callable[[torch.Tensor], torch.Tensor], token: torch.Tensor, steps: int, pick: Picker
) -> list[torch.Tensor]:
    """``token`` (B, 1) and ``steps`` more, each picked from ``step(the previous token)``'s logits (B, V) (one
    forward on the model's KV cache): the package's one decode loop, no early stop."""
    tokens = [token]
    for _ in range(steps):
        token = pick(step(token))
        tokens.append(token)
    return tokens


class Cached:
    """One causal LM on its KV cache: :meth:`feed` appends ids (B, k) to the cache through the model's eager forward
    and returns their logits (B, k, V); :meth:`advance` is one decode step through ``step`` (the forward, or its
    compiled decode step), returning the new position's logits (B, V); :meth:`cut` crops the cache back.
    ``positions``: each call is given its ``cache_position`` (transformers 4.x's static cache, never cropped)."""

    def __init__(self, lm: nn.Module, cache: Any = None, step: Any = None, positions: bool = False, length=None):
        forward = lm.forward
        self.lm, self.step, self.cache, self.positions = lm, step or lm, cache, positions
        self.keep = _keyword(forward, "logits_to_keep", "num_logits_to_keep")
        self.cache_kw = _keyword(forward, "cache", "past_key_values") or "past_key_values"
        self.length = length if length is not None else 0 if cache is None else int(cache.get_seq_length())

    def _forward(self, fn: Any, ids: torch.Tensor, last: bool = False) -> torch.Tensor:
        kwargs: dict[str, Any] = {keyword: 1} if last and (keyword := self.keep) else {}
        if self.cache is not None:
            kwargs[self.cache_kw] = self.cache
        if self.positions:
            kwargs["cache_position"] = torch.arange(self.length, self.length + ids.shape[1], device=ids.device)
        out = fn(input_ids=ids, use_cache=True, **kwargs)
        if self.cache is None:  # the cache the forward made (given one, transformers fills it in place)
            self.cache = getattr(out, "cache", None) or out.past_key_values
        self.length += ids.shape[1]
        return out.logits

    def feed(self, ids: torch.Tensor, last: bool = False) -> torch.Tensor:
        """``ids`` appended through the eager forward; ``last``: only the last position's logits where the model
        takes ``logits_to_keep`` (what ``generate``'s prefill does)."""
        return self._forward(self.lm, ids, last)

    def advance(self, token: torch.Tensor) -> torch.Tensor:
        return self._forward(self.step, token)[:, -1]

    def cut(self, length: int) -> None:
        """Back to ``length`` tokens.  A negative count of tokens to remove: what every transformers version's
        ``crop`` takes (4.x took a length or a negative count; 5.x a negative count only); never ``crop(0)``, which
        4.x read as a length of 0.  With ``positions`` the next call overwrites the slots (no crop)."""
        remove = self.length - length
        if remove > 0:
            if not self.positions:
                self.cache.crop(-remove)
            self.length = length


def generate(model: Cached, prompt: torch.Tensor, new_tokens: int, pick: Picker, last: bool = False) -> torch.Tensor:
    """``prompt`` (B, P) fed to ``model`` and followed by ``new_tokens`` picked tokens: (B, P + new_tokens)."""
    if new_tokens < 1:
        return prompt
    first = pick(model.feed(prompt, last)[:, -1])
    return torch.cat([prompt, *decode(model.advance, first, new_tokens - 1, pick)], dim=1)


# --------------------------------------------------------------------------- serving and sampling


class GreedyServing:
    """Prefill and greedy decode of one transformers causal LM on a fixed prompt batch, with the cell's generation
    backend (``generation``: None or dynamic, the eager dynamic cache).  :meth:`prefill` is the prefill row's call;
    :meth:`start` the (untimed) prefill the decode calls continue from; each :meth:`decode` call generates
    ``new_tokens`` tokens after the prefill's next token, one forward each, and cuts the cache back to the prompt."""

    def __init__(
        self,
        lm: nn.Module,
        ids: torch.Tensor,
        new_tokens: int,
        generation: Any = None,
        device_type: str = "cpu",
        store: dict | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.lm, self.ids, self.new_tokens, self.dtype = lm, ids, new_tokens, dtype
        self.keep = _keyword(lm.forward, "logits_to_keep", "num_logits_to_keep")
        self.static = is_static(generation)
        # transformers 4.x takes each step's cache_position: a static cache written at given slots needs no crop
        positions = self.static and _keyword(lm.forward, "cache_position") is not None
        self.store = {} if store is None else store  # what this serving compiled: let go with it (release)
        step = decode_step(lm, generation, device_type, self.store) if self.static else lm
        self.model = Cached(lm, step=step, positions=positions, length=0)
        self.first: torch.Tensor | None = None
        self.tokens: list[torch.Tensor] = []

    def prefill(self) -> Any:
        kwargs: dict[str, Any] = {"use_cache": True}
        if self.keep:
            kwargs[self.keep] = 1
        return self.lm(input_ids=self.ids, **kwargs)

    def start(self) -> None:
        """The prefill the decode calls continue from (untimed); a static cache is made and filled here."""
        self.model.cache, self.model.length = None, 0
        if self.static:
            batch, prompt = self.ids.shape
            dtype = self.dtype or next(self.lm.parameters()).dtype
            self.model.cache = static_cache(self.lm, batch, prompt + self.new_tokens, dtype, self.ids.device)
        self.first = GREEDY(self.model.feed(self.ids, last=True)[:, -1])

    def eager_step(self) -> None:
        """One decode step from the prefill through the eager forward (whatever the backend), then back to the
        prompt: an untimed look at what a step runs (:mod:`kdbench.models.attention_path`)."""
        self.model.feed(self.first)
        self.model.cut(self.ids.shape[1])

    def decode(self) -> torch.Tensor:
        self.tokens = decode(self.model.advance, self.first, self.new_tokens, GREEDY)
        self.model.cut(self.ids.shape[1])  # back to the prompt: every call decodes from the same state
        return self.tokens[-1]

    def generated(self) -> torch.Tensor:
        """The last decode call's tokens (B, 1 + new_tokens): the prefill's next token, then each step's."""
        return torch.cat(self.tokens, dim=1)


GREEDY = Picker()


def sample(
    lm: nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    vocab: int | None = None,
    generation: Any = None,
    store: dict | None = None,
) -> torch.Tensor:
    """``prompt`` (B, P) followed by ``new_tokens`` tokens sampled from ``lm`` (softmax(logits / temperature) over
    its first ``vocab`` entries, None: all; multinomial from ``generator``, which lies on the prompt's device), one
    forward per token on its KV cache, no early stop: (B, P + new_tokens).  ``generation``: the cell's backend
    (None: dynamic); a static cache of P + new_tokens positions is kept in ``store`` (the caller's dict, e.g. the
    on-policy phase's, let go with it) per model and shape and reset before each call's prefill, its decode steps
    compiled once per model where it says so."""
    store = {} if store is None else store
    model = Cached(lm, length=0)
    if is_static(generation):
        batch, length = prompt.shape
        model.cache = _sampling_cache(lm, batch, length + new_tokens, prompt.device, store)
        model.positions = _keyword(lm.forward, "cache_position") is not None  # transformers 4.x: slots given
        model.step = decode_step(lm, generation, prompt.device.type, store)
    return generate(model, prompt, new_tokens, Picker(temperature, generator, vocab), last=True)


def _sampling_cache(lm: nn.Module, batch: int, length: int, device: Any, store: dict) -> Any:
    """A static cache for :func:`sample`, kept in ``store`` per model, shape and dtype (its tensors keep their
    addresses, which a compiled step relies on) and reset (emptied) before each call; one at a time."""
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    dtype = dtype or next(lm.parameters()).dtype
    key = ("cache", id(lm), batch, length, dtype, str(device))
    if key not in store or store[key][0] is not lm:
        for k in [k for k in store if k[0] == "cache"]:  # one cache at a time: another shape's goes
            del store[k]
        store[key] = (lm, static_cache(lm, batch, length, dtype, device))
    cache = store[key][1]
    cache.reset()
    return cache


def greedy_generate(lm: nn.Module, prompt: torch.Tensor, new_tokens: int, vocab: int | None = None) -> torch.Tensor:
    """``prompt`` (B, P) followed by ``new_tokens`` greedy tokens of ``lm`` on its KV cache: (B, P + new_tokens).
    The reference speculative greedy output is held to, and the target-alone baseline a speculative row is timed
    against."""
    return generate(Cached(lm), prompt, new_tokens, Picker(vocab=vocab))


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
    return generate(Cached(lm), prompt, new_tokens, Picker(temperature, generator, vocab))


# --------------------------------------------------------------------------- speculative decoding


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
    if caches is not None:
        t, d = Cached(target, caches[0]), Cached(draft, caches[1])
        held = prompt.shape[1] - 1
        if t.length != held or d.length != held:
            why = f"the caches hold {t.length} and {d.length} tokens, not the prompt but its last ({held})"
            raise ValueError(why)
        try:
            return _rounds(t, d, prompt, new_tokens, draft_tokens, temperature, generator, vocab)
        finally:  # back to the prompt: the next call starts from the same state
            t.cut(held)
            d.cut(held)
    t, d = Cached(target), Cached(draft)
    if prompt.shape[1] > 1:  # both caches hold the prompt but its last token, which the first round feeds
        t.feed(prompt[:, :-1])
        d.feed(prompt[:, :-1])
    return _rounds(t, d, prompt, new_tokens, draft_tokens, temperature, generator, vocab)


def prefill(lm: nn.Module, prompt: torch.Tensor) -> Any:
    """``lm``'s KV cache holding ``prompt`` (1, P) but its last token: the state :func:`speculative_generate` starts
    from (``caches``).  A one-token prompt: an empty cache of the model's kind (transformers' DynamicCache)."""
    if prompt.shape[1] > 1:
        cached = Cached(lm)
        cached.feed(prompt[:, :-1])
        return cached.cache
    from transformers import DynamicCache

    try:
        return DynamicCache(config=lm.config)  # transformers >= 4.56 builds its layers from the config
    except TypeError:
        return DynamicCache()


def _rounds(
    t: Cached,
    d: Cached,
    prompt: torch.Tensor,
    new_tokens: int,
    draft_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    vocab: int | None,
) -> Speculation:
    """The rounds of :func:`speculative_generate` from caches ``t`` and ``d`` that hold the prompt but its last
    token."""
    greedy = temperature == 0
    ids = prompt
    out = Speculation(prompt, new_tokens)
    while ids.shape[1] - prompt.shape[1] < new_tokens:
        gamma = min(draft_tokens, new_tokens - (ids.shape[1] - prompt.shape[1]))
        # the draft proposes: first it catches up on committed tokens it has not seen (the last, and after a
        # round that accepted everything, the last proposal too)
        qs: list[torch.Tensor] = []
        pick = Picker(temperature, generator, vocab, None if greedy else qs)
        first = pick(d.feed(ids[:, d.length :])[:, -1])
        drafted = torch.cat(decode(d.advance, first, gamma - 1, pick), dim=1)  # (1, gamma)
        out.draft_forwards += gamma
        # the target verifies: its logits at the last committed token and at each proposal, in one forward
        logits = t.feed(torch.cat([ids[:, t.length :], drafted], dim=1))[..., :vocab].float()
        scores = logits[:, -(gamma + 1) :]  # (1, gamma + 1, V)
        out.verifies += 1
        out.proposed += gamma
        if greedy:
            best = scores.argmax(-1)  # (1, gamma + 1)
            agree = (best[:, :gamma] == drafted)[0].tolist()
            k = next((i for i, ok in enumerate(agree) if not ok), gamma)
            extra = best[:, k : k + 1]
        else:
            p = probabilities(scores[0], temperature)  # (gamma + 1, V)
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
