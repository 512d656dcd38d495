"""Serving a causal LM: prefill (the prompt's forward that fills the KV cache) and greedy decoding, timed.

Prefill: one call is the forward of ``batch_size`` prompts of ``data.seq_len`` tokens with
``use_cache``, keeping only the last position's logits where the model takes ``logits_to_keep``
(what ``generate`` does), so its time is the time to the first token.  Decode: one call generates
``inference.decode_tokens`` new tokens greedily (argmax), one forward per token on the KV cache of a
prefill done before the timed loop, with no early stop; after each call the cache is cut back to
the prompt, so every call starts from the same state.  Both run eval(), under inference_mode and the
cell's precision; ``tokens_per_s`` is the prompt tokens (prefill) or new tokens (decode) per second.

The decoding itself, and the generation backends (the cell's ``generation``: a dynamic or static cache, a compiled
decode step), are :mod:`kdbench.models.generation`'s (:class:`~kdbench.models.generation.GreedyServing`); this
module times them (:func:`kdbench.measure.serving.token_serving_row`).  A compiled decode step is compiled once per
model per measurement; what it compiled, and a static cache, are let go when the measurement ends, so that no later
measurement of the worker counts them in its memory.  Each row's one-off cost is its cold and warm-up calls' excess
over as many steady calls (the compile, for a compiled decode), and its tokens are checked against dynamic greedy
decoding once its timing is done (``output_check``).

Each row says how its GQA attention reached SDPA (``attention_path``, :mod:`kdbench.models.attention_path`):
watched on an untimed eager call before the timed loop (the prefill; one decode step from it, then cut back), and
for a compiled decode step, which takes another path than its eager pass where a static cache's mask rules out
SDPA's own GQA, from transformers' rule.  Where steps repeat K and V (``repeated``), the copy is counted in
``decode_bytes_per_token`` (:func:`~kdbench.measure.decode_floor.repeat_kv_bytes_per_token`) and a note says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.names import Measurement
from kdbench.core.schema import Row
from kdbench.hw.backends import Backend, choose_autocast
from kdbench.measure.decode_floor import (
    kv_bytes_per_position,
    kv_groups,
    model_decode_bytes_per_token,
    repeat_kv_bytes_per_token,
)
from kdbench.measure.failures import SkipMeasurement
from kdbench.measure.levers import release_compiled
from kdbench.measure.serving import compile_counters, token_serving_row
from kdbench.models.attention_path import REPEATED, observing, path_label
from kdbench.models.generation import GreedyServing, cache_dtype, is_static, release
from kdbench.workloads.base import Workload, served_precision_note
from kdbench.workloads.lm.xtok import cross_tokenizer, student_ids
from kdbench.workloads.placement import hold_for_serving


def measure_serving(
    workload: Workload,
    measurement: Measurement,
    model: nn.Module,
    pair: tuple[nn.Module, nn.Module],
    batch_size: int,
    config: CellConfig,
    backend: Backend,
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
    student = measurement in (Measurement.STUDENT_PREFILL, Measurement.STUDENT_DECODE)
    if student and cross_tokenizer(config):  # each model serves the text in its own tokens
        ids = student_ids(config, batch_size, backend.device, config.seed + 1)
    choice = choose_autocast(backend, config.precision)
    lm = model.lm
    lm.eval()
    held = hold_for_serving(lm, choice)  # as a deployment holds it: a bf16 cell serves bf16 weights
    generation = config.generation if decode else None
    pulled = decode and (is_static(generation) or generation.compile)
    dtype = cache_dtype(lm, choice)
    new = config.inference.decode_tokens
    gen = GreedyServing(lm, ids, new, generation, backend.device_type, {}, dtype)
    try:
        row = _served_row(workload, measurement, batch_size, config, backend, budget_s, choice, gen, decode, pulled)
        row["served_weights"] = held
        return row
    finally:
        if release(gen.store):  # the compiled step and its graphs: not alive in the next measurement
            release_compiled(backend)


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
    watched: dict[str, Any] = {}

    def start() -> None:  # untimed: the decode's prefill; the path one step (or the prefill) takes, watched
        if decode:
            gen.start()
        with observing() as seen:
            if decode:
                gen.eager_step()
            else:
                gen.prefill()
        watched["seen"] = seen

    args = (workload, measurement, batch_size, config, backend, budget_s, choice, call, ids, columns, notes)
    compiled = bool(pulled and generation.compile)
    if compiled:
        from torch._dynamo.utils import counters

        counters.clear()
    row = token_serving_row(*args, start=start, compiled=compiled)
    if "seen" in watched:
        _attention_path(row, watched["seen"], gen, decode, compiled, backend.device_type)
    if not pulled or row.get("median_ms") is None:
        return row
    row["one_off_ms"] = row["cold_excess_ms"]  # the cold and warm-up calls' excess: the compile, if any
    row["one_off_kind"] = "decode compile" if compiled else "static KV cache"
    if compiled:
        row.update(compile_counters())
    check, note = _same_tokens(gen, lm, ids, new, choice, backend)
    row["output_check"] = check
    if note:
        row["notes"] = "; ".join(n for n in (row.get("notes"), note) if n)
    return row


def _attention_path(row: Row, seen: Any, gen: GreedyServing, decode: bool, compiled: bool, device_type: str) -> None:
    """``attention_path`` of the row from what its untimed eager call showed (``seen``; for a compiled decode's
    steps, transformers' rule applied to it) and, on a decode row whose steps repeat K and V, the copy added to
    ``decode_bytes_per_token``, with a note."""
    config = gen.lm.config
    try:
        groups: int | None = kv_groups(config)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        groups = None
    paths = seen.compiled_paths(groups, 1, device_type) if compiled else seen.paths(groups)
    row["attention_path"] = path_label(paths) if paths else None
    if not decode or not paths or not paths[REPEATED] or row.get("decode_bytes_per_token") is None or not groups:
        return
    prompt, new = gen.ids.shape[1], gen.new_tokens
    attended = prompt + new if gen.static else prompt + (new - 1) / 2  # a static cache: its allocated length
    itemsize = torch.empty((), dtype=gen.dtype or next(gen.lm.parameters()).dtype).element_size()
    share = paths[REPEATED] / sum(paths.values())  # of the attention calls (layers) that repeat
    extra = share * repeat_kv_bytes_per_token(kv_bytes_per_position(config, itemsize), groups, attended)
    row["decode_bytes_per_token"] += extra
    how = "under torch.compile (its eager pass, which attention_kernel describes, does not) " if compiled else ""
    note = (
        f"attention_path: each step {how}runs transformers' repeat_kv, which writes K and V x {groups} at the "
        f"{attended:g} positions it attends and SDPA reads them back: +{extra:,.0f} bytes per token in "
        "decode_bytes_per_token"
    )
    row["notes"] = "; ".join(n for n in (row.get("notes"), note) if n)


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
        column, gap = first_difference_gap(lm, ids, got, want)
    return token_check(got, want, column, gap, gen.dtype or next(lm.parameters()).dtype)


def first_difference_gap(lm: nn.Module, ids: torch.Tensor, got: torch.Tensor, want: torch.Tensor):
    """Where the backend's greedy tokens ``got`` first differ from the reference's ``want`` (both (B, 1 + new)): the
    column, and the reference's top-2 gap there relative to its top logit (the largest over the sequences that
    differ), from a forward of the prompt and the reference's tokens before it.  (None, None) where they agree or
    their shapes differ.  Runs under the caller's inference mode and precision."""
    if got.shape != want.shape or torch.equal(got, want):
        return None, None
    column = int((got != want).any(0).nonzero()[0])
    rows = (got[:, column] != want[:, column]).nonzero().squeeze(1)
    context = torch.cat([ids, want[:, :column]], dim=1).index_select(0, rows)
    logits = lm(input_ids=context).logits[:, -1].float()
    top = logits.topk(2, dim=-1).values
    gap = ((top[:, 0] - top[:, 1]) / top[:, 0].abs().clamp_min(torch.finfo(torch.float32).tiny)).max()
    return column, float(gap)


def token_check(got, want, column: int | None, gap: float | None, dtype: torch.dtype) -> tuple[str, str]:
    """``output_check`` (and a note) of a backend's greedy tokens against the reference's.  Where they first differ
    at a near-tie of the reference (its top-2 logits within ``dtype``'s resolution, ``finfo.eps``, of the top one),
    rounding decides which token wins: two paths that round differently (another kernel, another cache layout) may
    pick either, so the check says so and compares no further (GPU review 4, M3) instead of calling it a mismatch."""
    n = want.numel()
    if torch.equal(got, want):
        return f"ok: the same {n} greedy tokens as the dynamic cache's", ""
    eps = torch.finfo(dtype).eps
    name = str(dtype).removeprefix("torch.")
    if column is not None and gap is not None and gap <= eps:
        return (
            f"ok to a near-tie: the same greedy tokens as the dynamic cache's up to token {column} of "
            f"{want.shape[1]}, where its top-2 logits differ by {gap:.1e} of the top one, within {name}'s "
            f"resolution ({eps:.1e}): rounding decides there, the rest is not compared"
        ), ""
    differ = int((got != want).sum()) if got.shape == want.shape else n
    why = f"MISMATCH: {differ} of the {n} greedy tokens differ from the dynamic cache's"
    if column is not None and gap is not None:
        why += f" (from token {column}, where its top-2 logits differ by {gap:.1e} of the top one)"
    return why, f"generation: {why} (the backend does not decode what the dynamic cache decodes)"
