"""Where a worker's wall time goes: seconds per category, taken per job and summed by the engine.

The categories are the run's wall-time split (:class:`kdbench.run.progress.WallSplit`): model
building, cold calls (compiles, autotuning, first-use set-up), warm-up (the warm-up calls),
measuring (the timed windows), FLOP counting, the fit check (one more step's measured peak and the fit
planner's fake run that predicts it), profiling passes, levers' one-off work (exports, compiles of served
models), quality training, the LM loss's accuracy ledger (:mod:`kdbench.distill.lm.ledger`).  What a job spends
outside them shows as the worker's "other".

Every addition is told to the engine (:func:`listen`), which keeps the last totals of the job in flight: a job
stopped half-way (its time-out, Ctrl-C) keeps the split it had told.  So a long job adds its time as it goes,
not in one block at its end: the quality job counts its training at least every 30 s
(:class:`kdbench.quality.progress.Talk`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kdbench.core.worker_state import current

MODELS, COLD, WARMUP, MEASURING, FLOPS, FIT, PROFILING, LEVERS, QUALITY, LEDGER = (
    "model building",
    "cold calls",
    "warm-up",
    "measuring",
    "FLOP counting",
    "fit check",
    "profiling",
    "lever set-up",
    "quality",
    "accuracy ledger",
)


# What every job of a run pays besides its measurements, named per job in the run's closing split (issue 45: a tiny
# cell's base cost is mostly these; ``--no-fit-check`` leaves the first out (``--fit-check auto`` for cells whose timed
# loop is shorter than it), an LM loss without the ledger the second)
PER_JOB = (FIT, LEDGER)


def per_job(split: dict[str, float], jobs: int) -> str:
    """The :data:`PER_JOB` categories of a run's split per job, for its closing line: ``'; a job's fit check 62 ms,
    accuracy ledger 4 ms (300 jobs)'`` ('' when the run spent nothing on them)."""
    spent = [(k, split[k]) for k in PER_JOB if split.get(k)]
    if not spent or jobs < 1:
        return ""
    each = ", ".join(f"{k} {v * 1e3 / jobs:,.0f} ms" for k, v in spent)
    return f"; a job's {each} ({jobs} job{'s' if jobs != 1 else ''})"


def listen(tell) -> None:
    """Have ``tell(totals)`` called with the seconds so far whenever a category grows (a worker sends them
    to the engine, which keeps the last ones of a job that times out)."""
    current().wall_listener = tell


def _told() -> None:
    state = current()
    if state.wall_listener is not None:
        state.wall_listener(dict(state.wall_s))


def add(category: str, seconds: float) -> None:
    current().wall_s[category] += seconds
    _told()


@contextlib.contextmanager
def spent(category: str) -> Iterator[None]:
    """Count the block's wall time to ``category``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        current().wall_s[category] += time.perf_counter() - start
        _told()


def so_far(category: str) -> float:
    """The seconds counted to ``category`` since the last take (a job's so far)."""
    return current().wall_s.get(category, 0.0)


def take() -> dict[str, float]:
    """The seconds counted since the last take, by category (and start afresh)."""
    spent = current().wall_s
    out = dict(spent)
    spent.clear()
    return out
