"""What a quality job says while it trains, and where its wall time goes as it goes.

A quality job trains model after model for minutes each.  :class:`Talk` logs (through ``logging``: in a worker
process the run's pipe carries each line to the run's output, :mod:`kdbench.run.workers`)

* one line as the job starts, before any data is read or any model built: how many models it will train;
* one as each model starts (which model of how many, seed, role, the epochs and steps ahead), or is taken from its
  checkpoint instead;
* then, while the model trains, one line at least every ``EVERY_S`` seconds (checked after every step): the epoch,
  the step, the training loss of the last step, the time spent on the model and an estimate of what is left of
  it (the steps left at the pace so far), and the time in the job so far.

Reading the loss waits for the device (one ``float``), once per line, not per step.  The clock that decides when
to speak is :func:`clock` (``time.monotonic``; tests replace it).

Each line also counts the training time since the previous one into the worker's wall-time split
(:func:`kdbench.measure.walltime.add`, category ``quality``), so the engine, which keeps the last split a worker
sent, attributes a quality job stopped half-way (Ctrl-C, a time-out) to quality, not to its own overhead.
"""

from __future__ import annotations

import logging
import time

import torch

from kdbench.measure import walltime

logger = logging.getLogger(__name__)

EVERY_S = 30.0  # at most this long between two lines while a model trains


def clock() -> float:
    """The clock that decides when to speak (seconds; tests replace it)."""
    return time.monotonic()


def _fmt(seconds: float) -> str:
    seconds = round(max(0.0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Talk:
    """A quality job's progress lines and its running wall-time account (see the module)."""

    def __init__(self, models: int, every_s: float = EVERY_S):
        self.models, self.every_s = models, every_s
        self.index = 0  # the model being trained (1-based), 0 before the first
        self.what = ""
        self.started = self.last = self.model_started = clock()
        self.counted = time.perf_counter()  # quality time counted into the wall-time split up to here

    def account(self) -> None:
        """Count the job's time since the last account into the worker's wall-time split (the engine hears it)."""
        now = time.perf_counter()
        walltime.add(walltime.QUALITY, now - self.counted)
        self.counted = now

    def job(self, describe: str) -> None:
        """The job starts: what it will train (before the data is read)."""
        logger.info("quality: %d models to train, %s; progress at least every %gs", self.models, describe, self.every_s)
        self.last = clock()

    def model(self, what: str) -> None:
        """The next model of the plan starts (``what``: its seed, role and name)."""
        self.index += 1
        self.what = what
        self.model_started = self.last = clock()

    @property
    def head(self) -> str:
        return f"quality [{self.index}/{self.models}] {self.what}"

    def reused(self, note: str) -> None:
        logger.info("%s: %s", self.head, note)
        self.account()

    def training(self, epochs: int, steps: int) -> None:
        """Training begins: ``epochs`` epochs of ``steps`` steps."""
        self.epochs, self.steps = epochs, steps
        logger.info("%s: training %d epochs x %d steps", self.head, epochs, steps)
        self.model_started = self.last = clock()
        self.account()

    def step(self, epoch: int, step: int, loss: torch.Tensor) -> None:
        """After step ``step`` (1-based) of epoch ``epoch`` (1-based): a line when ``every_s`` has passed."""
        now = clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        done = (epoch - 1) * self.steps + step
        spent = now - self.model_started
        left = spent / done * (self.epochs * self.steps - done)
        logger.info(
            "%s: epoch %d/%d, step %d/%d, loss %.4g; %s on this model, ~%s left of it; %s in the quality job",
            self.head,
            epoch,
            self.epochs,
            step,
            self.steps,
            float(loss),
            _fmt(spent),
            _fmt(left),
            _fmt(now - self.started),
        )
        self.account()
