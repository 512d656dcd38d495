"""Serving a causal LM: prefill (the prompt's forward that fills the KV cache) and greedy decoding.

Prefill: one call is the forward of ``batch_size`` prompts of ``data.seq_len`` tokens with
``use_cache``, keeping only the last position's logits where the model takes ``logits_to_keep``
(what ``generate`` does), so its time is the time to the first token.  Decode: one call generates
``inference.decode_tokens`` new tokens greedily (argmax), one forward per token on the KV cache of a
prefill done before the timed loop, with no early stop; after each call the cache is cropped back to
the prompt, so every call starts from the same state.  Both run eval(), under inference_mode and the
cell's precision; ``tokens_per_s`` is the prompt tokens (prefill) or new tokens (decode) per second.

Generation backends (the cell's ``generation``), for decode rows and the on-policy phase (:func:`sample`):
``cache: dynamic`` is transformers' default growing cache; ``cache: static`` preallocates ``StaticCache`` of
prompt + new tokens positions (the prefill fills it eagerly), and each decode call writes the same slots from the
prompt on: on transformers 5 (whose static layers crop by a negative count) the cache is cropped back to the
prompt after each call; on 4.x, whose forward takes ``cache_position``, each step is given its position, so each
call overwrites the slots it wrote before and the causal mask hides the rest.  ``compile: true`` (static only)
runs each decode step through ``torch.compile`` of the model's forward, as transformers documents for a static
cache (``fullgraph=True``; mode ``reduce-overhead`` on GPUs, ``default`` on the CPU, where CUDA graphs do not
exist), compiled once per model per measurement (:func:`decode_step`: a decode row, or the on-policy phase of a
step row; what it compiled, and a static cache, are let go when the measurement ends, so that no later
measurement of the worker counts them in its memory); the prefill stays eager.  Each row's one-off
cost is its cold and warm-up calls' excess over as many steady calls (the compile, for a compiled decode), and
its tokens are checked against dynamic greedy decoding once its timing is done (``output_check``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kdbench.core.names import Measurement
from kdbench.core.schema import Row
from kdbench.hw.backends import choose_autocast, math_flags, math_mode
from kdbench.measure import walltime
from kdbench.measure.decode_floor import model_decode_bytes_per_token
from kdbench.measure.failures import SkipMeasurement
from kdbench.measure.flops import count, kernel_label
from kdbench.measure.levers import eager, quiesce_compile_workers, release_compiled
from kdbench.measure.rows import profiled_loop, timed_row
from kdbench.workloads.base import served_precision_note


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
    for a static cache, ``default`` on the CPU), made once per model and kept in ``store``, the measurement's own
    dict (dropped with it); the first compile into an empty store resets ``torch._dynamo``, so that an earlier
    measurement's compiled decode does not make this one look free."""
    if generation is None or not generation.compile:
        return lm
    key = ("compiled", id(lm))
    if key not in store or store[key][0] is not lm:
        if not any(k[0] == "compiled" for k in store):
            torch._dynamo.reset()
        mode = "reduce-overhead" if device_type == "cuda" else None
        store[key] = (lm, torch.compile(lm.forward, mode=mode, fullgraph=True, dynamic=False))
    return store[key][1]


def release(store: dict, backend: Any) -> None:
    """Let go of what a measurement's ``store`` holds (compiled decode steps, static caches) and, where it compiled,
    of torch._dynamo's compiled code (:func:`kdbench.measure.levers.release_compiled`)."""
    compiled = any(k[0] == "compiled" for k in store)
    store.clear()
    if compiled:
        release_compiled(backend)


def is_static(generation: Any) -> bool:
    return generation is not None and generation.cache == "static"


class GreedyServing:
    """Prefill and greedy decode of one transformers causal LM on a fixed prompt batch, with the cell's generation
    backend (``generation``: None or dynamic, the eager dynamic cache)."""

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
        self.lm, self.ids, self.new_tokens = lm, ids, new_tokens
        forward = lm.forward
        self.keep = _keyword(forward, "logits_to_keep", "num_logits_to_keep")
        self.cache_kw = _keyword(forward, "cache", "past_key_values") or "past_key_values"
        self.static = is_static(generation)
        # transformers 4.x takes each step's cache_position: a static cache written at given slots needs no crop
        self.positions = self.static and _keyword(forward, "cache_position") is not None
        self.store = {} if store is None else store  # what this serving compiled: let go with it (release)
        self.step = decode_step(lm, generation, device_type, self.store) if self.static else lm
        self.dtype = dtype
        self.cache = None
        self.first = None
        self.tokens: list[torch.Tensor] = []

    def prefill(self) -> Any:
        kwargs: dict[str, Any] = {"use_cache": True}
        if self.keep:
            kwargs[self.keep] = 1
        out = self.lm(input_ids=self.ids, **kwargs)
        return out

    def start(self) -> None:
        """The prefill the decode calls continue from (untimed); a static cache is made and filled here."""
        if self.static:
            batch, prompt = self.ids.shape
            dtype = self.dtype or next(self.lm.parameters()).dtype
            self.cache = static_cache(self.lm, batch, prompt + self.new_tokens, dtype, self.ids.device)
            kwargs: dict[str, Any] = {"use_cache": True, self.cache_kw: self.cache}
            if self.keep:
                kwargs[self.keep] = 1
            if self.positions:
                kwargs["cache_position"] = torch.arange(prompt, device=self.ids.device)
            out = self.lm(input_ids=self.ids, **kwargs)
        else:
            out = self.prefill()
            self.cache = getattr(out, "cache", None) or out.past_key_values
        self.first = out.logits[:, -1:].argmax(-1)

    def decode(self) -> torch.Tensor:
        token = self.first
        tokens = [token]
        prompt = self.ids.shape[1]
        for i in range(self.new_tokens):
            kwargs: dict[str, Any] = {self.cache_kw: self.cache}
            if self.positions:
                kwargs["cache_position"] = torch.tensor([prompt + i], device=self.ids.device)
            out = self.step(input_ids=token, use_cache=True, **kwargs)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        if not self.positions:  # a negative count: crop(0) meant "to length 0" in transformers 4.x
            self.cache.crop(-self.new_tokens)  # back to the prompt: every call decodes from the same state
        self.tokens = tokens
        return token

    def generated(self) -> torch.Tensor:
        """The last decode call's tokens (B, 1 + new_tokens): the prefill's next token, then each step's."""
        return torch.cat(self.tokens, dim=1)


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
    forward = lm.forward
    keep = _keyword(forward, "logits_to_keep", "num_logits_to_keep")
    cache_kw = _keyword(forward, "cache", "past_key_values") or "past_key_values"
    kwargs: dict[str, Any] = {keep: 1} if keep else {}
    step: Callable[..., Any] = lm
    positions = False
    if is_static(generation):
        batch, length = prompt.shape
        cache = _sampling_cache(lm, batch, length + new_tokens, prompt.device, store)
        kwargs[cache_kw] = cache
        positions = _keyword(forward, "cache_position") is not None
        if positions:  # transformers 4.x: each step's slots given
            kwargs["cache_position"] = torch.arange(length, device=prompt.device)
        step = decode_step(lm, generation, prompt.device.type, store)
    out = lm(input_ids=prompt, use_cache=True, **kwargs)
    cache = getattr(out, "cache", None) or out.past_key_values
    tokens = [prompt]
    for i in range(new_tokens):
        probs = torch.softmax(out.logits[:, -1, :vocab].float() / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        tokens.append(token)
        if i + 1 < new_tokens:
            more = {"cache_position": torch.tensor([prompt.shape[1] + i], device=prompt.device)} if positions else {}
            out = step(input_ids=token, use_cache=True, **{cache_kw: cache}, **more)
    return torch.cat(tokens, dim=1)


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
    :class:`~kdbench.models.lm.CausalLM`), timed within ``budget_s``; a decode row with the cell's generation
    backend, its bytes per token (:mod:`kdbench.measure.decode_floor`) and, off the default backend, its one-off
    cost and its tokens checked against dynamic greedy decoding."""
    if not getattr(model, "hf", False):
        why = "prefill and decode need a transformers causal LM (its KV cache); this model returns logits"
        raise SkipMeasurement(why)
    decode = measurement in (Measurement.STUDENT_DECODE, Measurement.TEACHER_DECODE)
    ids, _ = workload.batch(config, batch_size, backend.device, config.seed + 1, pair)
    if measurement in (Measurement.STUDENT_PREFILL, Measurement.STUDENT_DECODE):
        from kdbench.workloads.lm.xtok import cross_tokenizer, student_ids

        if cross_tokenizer(config):  # each model serves the text in its own tokens
            ids = student_ids(config, batch_size, backend.device, config.seed + 1)
    choice = choose_autocast(backend, config.precision)
    lm = model.lm
    lm.eval()
    generation = config.generation if decode else None
    pulled = decode and (is_static(generation) or generation.compile)
    dtype = cache_dtype(lm, choice)
    new = config.inference.decode_tokens
    gen = GreedyServing(lm, ids, new, generation, backend.device_type, {}, dtype)
    try:
        return _served_row(workload, measurement, batch_size, config, backend, budget_s, choice, gen, decode, pulled)
    finally:
        release(gen.store, backend)  # the compiled step and its graphs: not alive in the next measurement


def _served_row(workload, measurement, batch_size, config, backend, budget_s, choice, gen, decode, pulled) -> Row:
    """The row of :func:`measure_serving` with its serving ``gen`` made."""
    lm, ids, new, generation = gen.lm, gen.ids, gen.new_tokens, config.generation
    dtype = gen.dtype

    def call() -> Any:
        with torch.inference_mode(), choice.context(backend.device_type):
            return gen.decode() if decode else gen.prefill()

    notes: tuple[str, ...] = (served_precision_note(measurement, config),)
    if not decode and gen.keep is None:
        notes += ("this model's forward has no logits_to_keep: the prefill computes the logits of every position",)
    columns: dict[str, Any] = {"decode_tokens": new if decode else None}
    if decode:
        itemsize = torch.empty((), dtype=dtype).element_size()
        try:
            per_token = model_decode_bytes_per_token(lm, itemsize, batch_size, ids.shape[1], new)
        except (AttributeError, TypeError, ValueError):  # a config without the usual layer and head numbers
            per_token = None
            notes += ("decode_bytes_per_token: this model's config does not give its layers, heads and head size",)
        columns["decode_bytes_per_token"] = per_token
    start = gen.start if decode else None
    args = (workload, measurement, batch_size, config, backend, budget_s, choice, call, ids, columns, notes)
    compiled = bool(pulled and generation.compile)
    if compiled:
        from torch._dynamo.utils import counters

        counters.clear()
    row = token_serving_row(*args, start=start, compiled=compiled)
    if not pulled or row.get("median_ms") is None:
        return row
    row["one_off_ms"] = row["cold_excess_ms"]  # the cold and warm-up calls' excess: the compile, if any
    row["one_off_kind"] = "decode compile" if compiled else "static KV cache"
    if compiled:
        row.update(_compile_counters())
    check, note = _same_tokens(gen, lm, ids, new, choice, backend)
    row["output_check"] = check
    if note:
        row["notes"] = "; ".join(n for n in (row.get("notes"), note) if n)
    return row


class _Quiesce:
    """The timed window of a compiled decode starts with inductor's compile workers ended (they start while the cold
    call compiles and import torch in the background for seconds after: :func:`quiesce_compile_workers`)."""

    def chain(self, other):
        def start() -> None:
            quiesce_compile_workers()
            if other:
                other[0]()

        return start, (other[1] if other else (lambda: None))


def _compile_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "compiled_graphs": int(counters["stats"]["unique_graphs"]),
    }


def _same_tokens(gen: GreedyServing, lm: nn.Module, ids, new: int, choice: Any, backend: Any) -> tuple[str, str]:
    """One more (untimed) call of the backend, after the timing, against the eager dynamic cache's decode from the
    same prompt (an untimed prefill and decode): ``output_check`` and, when the tokens differ, a note."""
    reference = GreedyServing(lm, ids, new)
    with torch.inference_mode(), choice.context(backend.device_type):
        gen.decode()  # the backend as timed (the FLOP count ran it eagerly)
        got = gen.generated()
        reference.start()
        reference.decode()
    want = reference.generated()
    if torch.equal(got, want):
        return f"ok: the same {want.numel()} greedy tokens as the dynamic cache's", ""
    differ = int((got != want).sum()) if got.shape == want.shape else want.numel()
    why = f"MISMATCH: {differ} of the {want.numel()} greedy tokens differ from the dynamic cache's"
    return why, f"generation: {why} (the backend does not decode what the dynamic cache decodes)"


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
    compiled: bool = False,
) -> Row:
    """The row of a served model's timed ``call`` on the token ``ids`` (LM prefill and decode, encoder forwards):
    timed at the cell's math mode after ``start`` (untimed, in inference mode) within ``budget_s``, FLOPs counted
    (and the attention kernels the call ran, read in the same pass; a ``compiled`` call's eagerly), tokens per
    second from the workload's token count, with the family's ``columns`` and ``notes``."""
    with math_mode(choice.tf32):
        if start is not None:
            with torch.inference_mode(), choice.context(backend.device_type):
                start()
        what = f"{config.pair.teacher}->{config.pair.student} {config.precision} {measurement} bs{batch_size}"
        watch = _Quiesce() if compiled else None
        raw, profile, note = profiled_loop(call, config, backend, batch_size, budget_s, watch=watch, what=what)
        flags = math_flags()
        with eager() if compiled else contextlib.nullcontext(), walltime.spent(walltime.FLOPS):
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
