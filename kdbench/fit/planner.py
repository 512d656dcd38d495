"""The peak memory of one device during a cell's distillation step, predicted by running the step on fake tensors.

:func:`predict` builds the cell's pair, batch and :class:`~kdbench.distill.step.DistillStep` through the
workload exactly as a measurement does, but under ``torch._subclasses.fake_tensor.FakeTensorMode``: every
tensor has its shape, dtype and bytes and none is allocated, and every operator runs its shape function only.
:class:`~kdbench.fit.tracker.LiveBytes` counts the live bytes operator by operator through the pair's build,
the teacher cache's build, and :data:`STEPS` steps (the first makes the optimizer's state; the peak of a timed
loop is that of a step with it), and says in which phase the peak falls and what it holds.

The fake run happens on the CPU device whatever device is asked about: the bytes of a tensor do not depend on
it.  What does (the attention kernel a GPU picks, autocast's op lists, the caching allocator's rounding, the
runtime's own context) is stated in docs/fit.md and in :func:`predict`'s notes; a cell whose fake run cannot
run an operator (no fake implementation, a value read back) is unpredictable, with the operator named.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kdbench.config.schema import CellConfig
from kdbench.distill.step import DistillStep
from kdbench.fakes import with_values
from kdbench.fit.tracker import GRADIENTS, INPUTS, KINDS, OPTIMIZER, PARAMETERS, LiveBytes
from kdbench.hw.backends import Backend
from kdbench.models.cache import ModelCache
from kdbench.models.lm import as_measured_batches
from kdbench.names import GENERATE, PHASES
from kdbench.workloads.registry import workload_of

STEPS = 2  # fake steps run: the second is a step with the optimizer's state, as every timed one is
CPU = Backend(name="cpu", device=torch.device("cpu"))


@dataclass(frozen=True)
class Prediction:
    """One device's predicted peak during a cell's distillation step (None with ``error``: unpredictable)."""

    peak_bytes: int | None
    phase: str | None = None  # the phase the peak falls in: "setup", "cache build", or a step phase's name
    breakdown: dict[str, int] = field(default_factory=dict)  # bytes at the peak by kind (tracker.KINDS)
    logits_bytes: int | None = None  # an LM step's logits buffers, from the loss's own count
    host_bytes: int | None = None  # what the cell's models take of rank 0's host (the plan's count)
    host: str = ""  # the host figure in words, per rank
    seconds: float = 0.0  # what the fake run took
    error: str | None = None  # why the cell is unpredictable
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.peak_bytes is not None


class _PhaseClock:
    """A step clock whose stamps move the tracker into the step's next phase (:data:`kdbench.names.PHASES`)."""

    name = "phases"
    host = True

    def __init__(self, tracker: LiveBytes, on_policy: bool):
        self.tracker = tracker
        self.order = [p.name for p in ((GENERATE, *PHASES) if on_policy else PHASES)]
        self.i = 0

    def stamp(self) -> int:
        # a step stamps len(order) + 1 times: its start, then the end of each phase
        self.tracker.phase = self.order[self.i] if self.i < len(self.order) else "after the step"
        self.i = self.i + 1 if self.i < len(self.order) else 0
        return 0

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return 0.0

    def sync(self) -> None:
        pass


def unpredictable(exc: BaseException) -> str:
    """Why a fake run failed, naming the operator where torch says which."""
    func = getattr(exc, "func", None)
    what = type(exc).__name__
    if func is not None:
        return f"the fake run cannot run {func} ({what}): no shape-only implementation of it, or it reads values"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else what
    return f"the fake run failed: {what}: {text[:300]}"


def predict(config: CellConfig, device_type: str = "cuda") -> Prediction:
    """The predicted peak of one device (rank 0's) during ``config``'s distillation step; ``device_type`` is the
    device asked about (the host figure depends on it; the fake run is the CPU's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    workload = workload_of(config)
    host = workload.host_footprint(config, device_type)
    host_bytes = host.rank_bytes(True) if host.unknown is None else None
    host_text = host.summary(config.world_size) if host.unknown is None else host.unknown
    skip = workload.skip_reason(config, CPU)
    if skip:
        return Prediction(None, host_bytes=host_bytes, host=host_text, error=f"not predicted: {skip}")
    if config.world_size > 1:
        return Prediction(
            None, host_bytes=host_bytes, host=host_text, error="not predicted: data-parallel cells come with issue 31's next step"
        )
    start = time.perf_counter()
    tracker = LiveBytes()
    notes: list[str] = []
    step = None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, as_measured_batches(), tracker:
            # no model kept: a kept one is deep-copied per use, which reads a fake tensor's data pointer
            teacher, student = workload.step_pair(config, CPU, ModelCache(capacity=0), None)
            tracker.track(_tensors(teacher, student), PARAMETERS)
            with torch._subclasses.fake_tensor.unset_fake_temporarily():  # the batch's values decide shapes
                x, y = workload.batch(config, config.batch_size, CPU.device, config.seed, (teacher, student))
            x, y = (with_values(mode.from_tensor(t), t) for t in (x, y))
            tracker.track((x, y), INPUTS)
            tracker.phase = "cache build"
            step = DistillStep(teacher, student, x, y, config, CPU, workload, diagnostics=False)
            distiller = step.distiller
            if distiller.scaler is not None:  # its found-inf check reads values; it holds a few scalars
                distiller.scaler = None
                notes.append("fp16's loss scaling not run (a few scalars)")
            step.clock = _PhaseClock(tracker, config.on_policy is not None)
            for p in distiller.trainee.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: tracker.mark([p.grad], GRADIENTS))
            tracker.track(_tensors(distiller.trainee), PARAMETERS)  # the adapters feature methods train
            for _ in range(STEPS):
                step()
                tracker.mark(_state(distiller.optimizer), OPTIMIZER)
            logits = _logits_bytes(distiller.loss_fn, x)
    except Exception as exc:  # noqa: BLE001 - any failure of the fake run makes the cell unpredictable, said why
        return Prediction(
            None, host_bytes=host_bytes, host=host_text, seconds=time.perf_counter() - start, error=unpredictable(exc)
        )
    finally:
        if step is not None:
            step.close()
    return Prediction(
        tracker.peak.bytes,
        phase=tracker.peak.phase,
        breakdown={k: v for k, v in tracker.breakdown().items() if k in KINDS},
        logits_bytes=logits,
        host_bytes=host_bytes,
        host=host_text,
        seconds=time.perf_counter() - start,
        notes=tuple(notes),
    )


def _tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _logits_bytes(loss: Any, x: torch.Tensor) -> int | None:
    count = getattr(loss, "logits_memory", None)
    return int(count(x.numel())["bytes"]) if count is not None else None
