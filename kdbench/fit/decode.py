"""A fake run's decode loop cut short and extrapolated: what an on-policy step's generation costs the planner.

GKD's on-policy phase has the student sample ``on_policy.new_tokens`` tokens, one forward each on its KV cache
(:func:`kdbench.models.generation.decode`).  Under ``FakeTensorMode`` every operator costs about a millisecond
of Python, so 128 tokens of an 8B-class model made most of a fit's minutes, for figures that follow from a few
steps: a decode step's operators are the same at every length but for the cache's length, so

* the live bytes at a step's end grow by the same amount a step (the cache's new position: ``c``), and its peak
  by the same amount a step (``d``: the cache and the step's temporaries over it, attention's scores included);
* a step's census (its operators' FLOPs, bytes and launches) grows by the same records a step.

:func:`short_decode` replaces the loop, for the fake run only, by one that runs :data:`DECODE_STEPS` steps, checks
that the last three grew by the same live bytes, peak bytes and census records (else it runs every step: exact),
and lays the rest over the meter: the cache's missing positions as one storage held as long as the cache (the
model on its cache, :class:`kdbench.models.generation.Cached`, holds it), the last step's peak as a temporary
made and freed at once, the skipped steps' tokens, and their census records (each record's growth summed over
the steps skipped).  The peak is then the full loop's to the byte when the growth is linear (a test compares
them); the census's ``fresh`` bytes (new storages of at least 32 MiB) are extrapolated linearly, which is exact
unless a skipped step's storage crosses that threshold.  The prediction says that it was extrapolated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kdbench.fit.tracker import SEGMENT

DECODE_STEPS = 4  # decode steps a fake run makes of an on-policy generation: the first, then three to compare

# a census's records: (op, class, phase, dtype) -> (flops, read, written, launches, fresh)
Counts = dict[tuple[str, str, str, str], tuple[int, ...]]


class ShortDecode:
    """What :func:`short_decode` did: ``steps`` decode steps the loops asked for, ``ran`` of them run."""

    def __init__(self) -> None:
        self.steps = 0
        self.ran = 0
        self.loops = 0  # generations (each step of the fake run generates once)
        self.why_full = ""  # why a loop ran every step (its growth was not linear)

    @property
    def note(self) -> str:
        if not self.steps or self.ran == self.steps:
            return f"the on-policy generation decoded in full ({self.why_full})" if self.why_full else ""
        return (
            f"on-policy generation extrapolated: {self.ran} of {self.steps} decode steps run ({self.loops} "
            "generations), the rest laid over the meter (the KV cache, each step's peak and its operators grow "
            "linearly, checked over the last 3)"
        )


def _counts(census: Any) -> Counts:
    return {
        (r.op, r.cls, r.phase, r.dtype): (r.flops, r.read, r.written, r.launches, r.fresh)
        for r in census.census().records
    }


def _delta(after: Counts, before: Counts) -> Counts:
    """``after - before`` record by record (the records of either), zeros left out."""
    zero = (0, 0, 0, 0, 0)
    out = {k: tuple(a - b for a, b in zip(after.get(k, zero), before.get(k, zero))) for k in {*after, *before}}
    return {k: v for k, v in out.items() if any(v)}


@contextlib.contextmanager
def short_decode(tracker: Any, census: Any, steps: int | None = DECODE_STEPS) -> Iterator[ShortDecode]:
    """:func:`kdbench.models.generation.decode` cut to ``steps`` steps and extrapolated (module docstring) while
    open, metered by ``tracker`` (:class:`kdbench.fit.tracker.LiveBytes`) and counted by ``census``
    (:class:`kdbench.fit.census.CensusMode`); ``steps`` None: every step run (the reference)."""
    from kdbench.models import generation

    done = ShortDecode()
    full = generation.decode
    if steps is None:
        yield done
        return

    def decode(step: Callable, token: torch.Tensor, n: int, pick: Any) -> list[torch.Tensor]:
        done.steps += n
        done.loops += 1
        owner = getattr(step, "__self__", None)  # the model on its cache: the extrapolated cache lives with it
        segment = tracker.segment  # each step its own segment of the phase: one pass through the stack

        def part(name: str) -> None:
            tracker.segment = f"{segment}{SEGMENT}{name}"

        if n <= max(steps, 3) or owner is None:
            done.ran += n
            tokens = [token]
            for i in range(n):
                part(f"decode {i + 1}")
                tokens += full(step, tokens[-1], 1, pick)[1:]
            part("after decode")
            return tokens
        tokens, peaks, ends, counts = [token], [], [], [_counts(census)]
        for i in range(steps):
            part(f"decode {i + 1}")
            saved = tracker.peak
            tracker.reset_peak()  # this step's own peak, from what is live as it starts
            token = pick(step(token))
            tokens.append(token)
            peaks.append(tracker.peak.bytes)
            ends.append(tracker.live)
            counts.append(_counts(census))
            if saved.bytes >= tracker.peak.bytes:
                tracker.peak = saved
        done.ran += steps
        grow = [ends[-1] - ends[-2], peaks[-1] - peaks[-2]]
        per_step = [_delta(counts[i], counts[i - 1]) for i in range(len(counts) - 3, len(counts))]  # the last 3
        growth = _delta(per_step[2], per_step[1])
        if grow != [ends[-2] - ends[-3], peaks[-2] - peaks[-3]] or growth != _delta(per_step[1], per_step[0]):
            done.why_full = "its steps did not grow linearly"
            done.ran += n - steps
            part("decode rest")  # many passes: no depth extrapolation lines it up
            rest_tokens = full(step, token, n - steps, pick)[1:]
            part("after decode")
            return [*tokens, *rest_tokens]
        rest = n - steps
        part("decode rest")
        on, census.on = census.on, False  # what is laid over the meter is no operator of the step
        try:
            before = tracker.live
            tokens += [torch.empty_like(token) for _ in range(rest)]  # the skipped steps' tokens
            cache = grow[0] * rest - (tracker.live - before)  # the positions the skipped steps add to the cache
            if cache > 0:  # held as long as the cache is: by the model on it
                owner._fit_extrapolated = torch.empty(cache, dtype=torch.uint8)
            peak = (peaks[-1] - ends[-1]) + (grow[1] - grow[0]) * rest
            if peak > 0:  # the last skipped step's peak over what it leaves: made and freed at once
                temporary = torch.empty(peak, dtype=torch.uint8)
                del temporary
        finally:
            census.on = on
            part("after decode")
        _extrapolate_census(census, per_step[2], growth, rest)
        return tokens

    generation.decode = decode
    try:
        yield done
    finally:
        generation.decode = full


def _extrapolate_census(census: Any, last: Counts, growth: Counts, rest: int) -> None:
    """The census records of ``rest`` more decode steps: step j after the last run adds ``last + j x growth``,
    summed: ``rest x last + growth x rest (rest + 1) / 2``."""
    from kdbench.fit.census import Record

    if not census.on or not rest:
        return
    zero = (0, 0, 0, 0, 0)
    weight = rest * (rest + 1) // 2
    records = []
    for key in {*last, *growth}:
        a, g = last.get(key, zero), growth.get(key, zero)
        values = tuple(rest * x + weight * y for x, y in zip(a, g))
        if any(values):
            records.append(Record(*key, *values))
    census.add(records)
