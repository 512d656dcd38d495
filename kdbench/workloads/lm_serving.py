"""Serving a causal LM: prefill (the prompt's forward that fills the KV cache) and greedy decoding.

Prefill: one call is the forward of ``batch_size`` prompts of ``data.seq_len`` tokens with
``use_cache``, keeping only the last position's logits where the model takes ``logits_to_keep``
(what ``generate`` does), so its time is the time to the first token.  Decode: one call generates
``inference.decode_tokens`` new tokens greedily (argmax), one forward per token on the KV cache of a
prefill done before the timed loop, with no early stop; after each call the cache is cropped back to
the prompt, so every call starts from the same state.  Both run eval(), under inference_mode and the
cell's precision; ``tokens_per_s`` is the prompt tokens (prefill) or new tokens (decode) per second.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from kdbench.hw.backends import choose_autocast, math_flags, math_mode
from kdbench.measure import walltime
from kdbench.measure.failures import SkipMeasurement
from kdbench.measure.flops import count, kernel_label
from kdbench.measure.rows import profiled_loop, timed_row
from kdbench.names import Measurement
from kdbench.schema import Row
from kdbench.workloads.base import served_precision_note


def _keyword(forward, *names: str) -> str | None:
    """The first of ``names`` the model's forward takes (transformers renamed several across versions)."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    return next((n for n in names if n in params), None)


class GreedyServing:
    """Prefill and greedy decode of one transformers causal LM on a fixed prompt batch."""

    def __init__(self, lm: nn.Module, ids: torch.Tensor, new_tokens: int):
        self.lm, self.ids, self.new_tokens = lm, ids, new_tokens
        forward = lm.forward
        self.keep = _keyword(forward, "logits_to_keep", "num_logits_to_keep")
        self.cache_kw = _keyword(forward, "cache", "past_key_values") or "past_key_values"
        self.cache = None
        self.first = None

    def prefill(self) -> Any:
        kwargs: dict[str, Any] = {"use_cache": True}
        if self.keep:
            kwargs[self.keep] = 1
        out = self.lm(input_ids=self.ids, **kwargs)
        return out

    def start(self) -> None:
        """The prefill the decode calls continue from (untimed)."""
        out = self.prefill()
        self.cache = getattr(out, "cache", None) or out.past_key_values
        self.first = out.logits[:, -1:].argmax(-1)

    def decode(self) -> torch.Tensor:
        token = self.first
        for _ in range(self.new_tokens):
            out = self.lm(input_ids=token, use_cache=True, **{self.cache_kw: self.cache})
            token = out.logits[:, -1:].argmax(-1)
        self.cache.crop(-self.new_tokens)  # back to the prompt: every call decodes from the same state
        return token


def sample(
    lm: nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    vocab: int | None = None,
) -> torch.Tensor:
    """``prompt`` (B, P) followed by ``new_tokens`` tokens sampled from ``lm`` (softmax(logits / temperature) over
    its first ``vocab`` entries, None: all; multinomial from ``generator``, which lies on the prompt's device), one
    forward per token on its KV cache, no early stop: (B, P + new_tokens)."""
    forward = lm.forward
    keep = _keyword(forward, "logits_to_keep", "num_logits_to_keep")
    cache_kw = _keyword(forward, "cache", "past_key_values") or "past_key_values"
    out = lm(input_ids=prompt, use_cache=True, **({keep: 1} if keep else {}))
    cache = getattr(out, "cache", None) or out.past_key_values
    tokens = [prompt]
    for i in range(new_tokens):
        probs = torch.softmax(out.logits[:, -1, :vocab].float() / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        tokens.append(token)
        if i + 1 < new_tokens:
            out = lm(input_ids=token, use_cache=True, **{cache_kw: cache})
    return torch.cat(tokens, dim=1)


def measure_serving(
    workload,
    measurement: Measurement,
    model: nn.Module,
    pair: tuple[nn.Module, nn.Module],
    batch_size: int,
    config: Any,
    backend: Any,
    budget_s: float | None,
) -> Row:
    """The prefill or decode row of ``model``, the teacher or the student of ``pair`` (a
    :class:`~kdbench.models.lm.CausalLM`), timed within ``budget_s``."""
    if not getattr(model, "hf", False):
        why = "prefill and decode need a transformers causal LM (its KV cache); this model returns logits"
        raise SkipMeasurement(why)
    decode = measurement in (Measurement.STUDENT_DECODE, Measurement.TEACHER_DECODE)
    ids, _ = workload.batch(config, batch_size, backend.device, config.seed + 1, pair)
    choice = choose_autocast(backend, config.precision)
    lm = model.lm
    lm.eval()
    gen = GreedyServing(lm, ids, config.inference.decode_tokens)

    def call() -> Any:
        with torch.inference_mode(), choice.context(backend.device_type):
            return gen.decode() if decode else gen.prefill()

    notes: tuple[str, ...] = (served_precision_note(measurement, config),)
    if not decode and gen.keep is None:
        notes += ("this model's forward has no logits_to_keep: the prefill computes the logits of every position",)
    columns = {"decode_tokens": config.inference.decode_tokens if decode else None}
    start = gen.start if decode else None
    args = (workload, measurement, batch_size, config, backend, budget_s, choice, call, ids, columns, notes)
    return token_serving_row(*args, start=start)


def token_serving_row(
    workload,
    measurement: Measurement,
    batch_size: int,
    config: Any,
    backend: Any,
    budget_s: float | None,
    choice: Any,
    call,
    ids: torch.Tensor,
    columns: dict[str, Any],
    notes: tuple[str, ...] = (),
    start=None,
) -> Row:
    """The row of a served model's timed ``call`` on the token ``ids`` (LM prefill and decode, encoder forwards):
    timed at the cell's math mode after ``start`` (untimed, in inference mode) within ``budget_s``, FLOPs counted
    (and the attention kernels the call ran, read in the same pass), tokens per second from the workload's token
    count, with the family's ``columns`` and ``notes``."""
    with math_mode(choice.tf32):
        if start is not None:
            with torch.inference_mode(), choice.context(backend.device_type):
                start()
        what = f"{config.pair.teacher}->{config.pair.student} {config.precision} {measurement} bs{batch_size}"
        raw, profile, note = profiled_loop(call, config, backend, batch_size, budget_s, what=what)
        flags = math_flags()
        with walltime.spent(walltime.FLOPS):
            counted = None if raw.note else count(call)
    return timed_row(
        measurement,
        batch_size,
        raw,
        tokens=workload.tokens(measurement, batch_size, config),
        choices=(choice,),
        notes=(note, raw.note or "", *notes),
        **profile,
        **flags,
        flops=counted.flops if counted is not None else None,
        attention_kernel=kernel_label(counted.attention) if counted is not None else None,
        autocast=choice.applied,
        runtime="eager",
        seq_len=config.data.seq_len,
        **columns,
        data_ptr_mod64=ids.data_ptr() % 64,
    )
