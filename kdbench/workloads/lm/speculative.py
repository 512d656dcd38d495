"""The cell's speculative_decode rows: the teacher (the target) generating with the student (a draft) proposing
tokens, timed.

The loop itself (the draft's proposals, the target's verify step, greedy and sampled acceptance, the caches cut
back to the committed tokens) is :func:`kdbench.models.generation.speculative_generate`; its expected figures are
:mod:`kdbench.core.speculation`'s.  This module plans the rows (one per draft length and temperature, batch size
1), times the generation from caches prefilled before the timed loop, and counts the bytes a generated token must
read.  One untimed call after the prefill is watched for how each model's attention reached SDPA
(``attention_path``, :mod:`kdbench.models.attention_path`): a forward of several tokens on a cache (the teacher's
verify) carries a causal mask, which rules out SDPA's own GQA, so transformers repeats K and V over the cache; that
copy is counted in ``decode_bytes_per_token``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.names import Measurement, Speculative, variant_columns
from kdbench.core.schema import Row
from kdbench.hw.backends import Backend, choose_autocast
from kdbench.measure.decode_floor import kv_groups, model_decode_bytes_per_token
from kdbench.measure.failures import SkipMeasurement
from kdbench.measure.serving import token_serving_row
from kdbench.models.attention_path import observing, path_label
from kdbench.models.generation import Speculation, cache_dtype, prefill, speculative_generate
from kdbench.workloads.base import Workload
from kdbench.workloads.lm.checks import shared_vocab
from kdbench.workloads.placement import hold_for_serving

SAMPLED_AGAINST_GREEDY = (
    "sampled verification (temperature {t:g}) against the teacher's greedy decode row: spec_speedup compares this "
    "row with an argmax per token; sampling adds a softmax and a draw per position to this row's work"
)


def planned_speculative(config: CellConfig) -> list[tuple[Measurement, int]]:
    """The cell's speculative_decode measurements (``inference.speculative``): one per draft length and temperature
    (draft-length-major), each at batch size 1, as :class:`~kdbench.core.names.Speculative` (the measurement carrying
    its variant)."""
    spec = config.inference.speculative
    if spec is None:
        return []
    return [(Speculative(g, t), 1) for g in spec.draft_tokens for t in spec.temperature]


def measure_speculative(
    workload: Workload,
    measurement: Measurement,
    pair: tuple[nn.Module, nn.Module],
    batch_size: int,
    config: CellConfig,
    backend: Backend,
    budget_s: float | None,
) -> Row:
    """The speculative_decode row of ``measurement`` (a :class:`~kdbench.core.names.Speculative`: its draft length and
    temperature): the teacher (``pair[0]``) generating ``inference.decode_tokens`` new tokens after the cell's
    batch-size-1 prompt (the decode rows' first prompt) with the student (``pair[1]``) as its draft, timed within
    ``budget_s``.  Both models eval, under inference mode and the cell's precision; both prompts prefilled before
    the timed loop (untimed) and their caches cut back to them after each call; a sampled call draws from a
    generator seeded the same at its start (every call does the same work).  The row holds the counts of the last
    call (every call's are the same)."""
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
    held = (hold_for_serving(target, choice), hold_for_serving(draft, choice))  # as deployments hold them
    seed = config.seed + 2
    generator = torch.Generator(device=backend.device) if temperature > 0 else None
    state: dict[str, Any] = {}

    def start() -> None:  # both prompts in their caches (untimed; called under inference mode and the precision)
        state["caches"] = (prefill(target, ids), prefill(draft, ids))
        with observing({"teacher": target, "student": draft}) as seen:  # one call watched; it cuts the caches back
            call()
        state["seen"] = seen

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
    columns = {
        "decode_tokens": new_tokens,
        "served_weights": held[0] if held[0] == held[1] else f"{held[0]}/{held[1]}",
        **variant,
    }
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
    if "seen" in state:
        _attention_path(row, state["seen"], target, draft, new_tokens)
    return row


def _attention_path(row: Row, seen: Any, target: nn.Module, draft: nn.Module, new_tokens: int) -> None:
    """``attention_path`` of a speculative row from its watched call ``seen`` (``teacher X, student Y`` where the
    models' paths differ) and the bytes repeat_kv wrote in it, written and read back, per generated token, added to
    ``decode_bytes_per_token`` with a note."""
    labels = []
    for name, lm in (("teacher", target), ("student", draft)):
        try:
            groups: int | None = kv_groups(lm.config)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            groups = None
        paths = seen.paths(groups, name)
        labels.append(path_label(paths) if paths else None)
    teacher, student = labels
    if teacher is not None and student is not None:
        row["attention_path"] = teacher if teacher == student else f"teacher {teacher}, student {student}"
    written = seen.repeat_bytes("teacher") + seen.repeat_bytes("student")
    if not written or row.get("decode_bytes_per_token") is None:
        return
    extra = 2 * written / new_tokens
    row["decode_bytes_per_token"] += extra
    note = (
        "attention_path: forwards of several tokens on a cache (the teacher's verify) run transformers' repeat_kv, "
        f"which writes K and V x groups at every position they attend and SDPA reads them back: +{extra:,.0f} "
        "bytes per token in decode_bytes_per_token"
    )
    row["notes"] = "; ".join(n for n in (row.get("notes"), note) if n)


def speculative_bytes_per_token(target: nn.Module, draft: nn.Module, choice: Any, prompt_len: int, run: Speculation):
    """The bytes a speculative generation must read per generated token (its memory-bandwidth floor, as
    :mod:`kdbench.measure.decode_floor` counts a decode step's): each verify step reads the target's weights and KV
    cache once, each draft forward the draft's, over the ``run``'s counts: ``(verifies × target_bytes +
    draft_forwards × draft_bytes) / new_tokens``, each model's bytes per step those of a batch-1 decode over the
    same span (:func:`~kdbench.measure.decode_floor.model_decode_bytes_per_token`).  None where a config does not
    give its layer and head numbers."""
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
