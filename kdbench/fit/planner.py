"""The peak memory of one device during a cell's distillation step, predicted by running the step on fake tensors.

:func:`predict` builds the cell's pair, batch and :class:`~kdbench.distill.step.DistillStep` through the
workload exactly as a measurement does, but under ``torch._subclasses.fake_tensor.FakeTensorMode``: every
tensor has its shape, dtype and bytes and none is allocated, and every operator runs its shape function only.
:class:`~kdbench.fit.tracker.LiveBytes` counts the live bytes operator by operator through the pair's build,
the teacher cache's build, and :data:`STEPS` steps (the first makes the optimizer's state; the peak of a timed
loop is that of a step with it), and says in which phase the peak falls and what it holds.  Where the first step
leaves nothing for the second but its gradients, the optimizer's state and what an on-policy generation keeps (one
device, no alignment or reader), those are made without running it (:func:`prime_first_step`: zero gradients and
one update from them, the generation run once) and one step runs: half the operators, the same peak, breakdown
and census (tested against the two-step run).

The fake run happens on the CPU device whatever device is asked about: the bytes of a tensor do not depend on
it.  The operator choices that do are a GPU's for a GPU target (autocast's op lists, fused attention and
dropout, sort's workspace: :mod:`kdbench.fit.gpu_target`); the caching allocator's rounding and the runtime's
own context are stated in docs/fit.md and in :func:`predict`'s notes; a cell whose fake run cannot
run an operator (no fake implementation, a value read back) is unpredictable, with the operator named.

The same run takes the step's operator census (:class:`~kdbench.fit.census.CensusMode`, on for the last fake step):
each operator's FLOPs, bytes, dtype, phase and class, which :mod:`kdbench.fit.steptime` prices into the step's
time on a device; one fake run gives both answers (:attr:`Prediction.census`).

An on-policy step's generation decodes a few tokens and extrapolates the rest (:mod:`kdbench.fit.decode`: the KV
cache and each decode step grow linearly, checked), which the prediction's notes say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from kdbench.config.schema import CellConfig
from kdbench.core.fakes import known_values, with_values
from kdbench.core.names import PHASES, Phase
from kdbench.distill.step import DistillStep
from kdbench.fit.census import Census, CensusMode, all_reduce_record
from kdbench.fit.decode import DECODE_STEPS, short_decode
from kdbench.fit.gpu_target import GpuTarget
from kdbench.fit.tracker import GRADIENTS, INPUTS, OPTIMIZER, PARAMETERS, LiveBytes
from kdbench.hw.backends import Backend
from kdbench.models.cache import ModelCache
from kdbench.models.lm import as_measured_batches
from kdbench.models.seeded import skipped_inits, undrawn
from kdbench.workloads.registry import workload_of

STEPS = 2  # fake steps run: the second is a step with the optimizer's state, as every timed one is
# A cell's settings that cannot change its fake run: how it is timed, and what compiles or tunes its kernels (the fake
# run is eager: a compiled student's predicted peak and census are the eager one's, tested), so that cells differing
# only in them share one fake run (llm-cuda.yaml's compiled fused_linear cases: 8 of its 52 cells)
NOT_IN_FAKE_RUN = ("timing", "compile", "compile_teacher", "conv_autotune", "tunableop")
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
    comm_bytes: int = 0  # NCCL's/RCCL's buffers per rank, outside the allocator: not in peak_bytes (fit.runtime)
    census: Census | None = None  # the last fake step's operators (kdbench.fit.census): what its time is priced from
    # each phase's own peak and what it held (phase -> (bytes, breakdown)), where asked (predict's phase_peaks)
    phase_peaks: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    # the run's meter (kdbench.fit.tracker.LiveBytes), kept with phase_peaks for kdbench.fit.depth, which reads its
    # trajectory and drops it; never handed between processes
    meter: Any = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.peak_bytes is not None


class _PhaseClock:
    """A step clock whose stamps move the tracker into the step's next phase (:data:`kdbench.core.names.PHASES`)."""

    name = "phases"
    host = True

    def __init__(self, tracker: LiveBytes, lead: Phase | None):
        self.tracker = tracker
        self.order = [p.name for p in ((lead, *PHASES) if lead is not None else PHASES)]
        self.i = 0

    def stamp(self) -> int:
        # a step stamps len(order) + 1 times: its start, then the end of each phase
        self.tracker.phase = self.order[self.i] if self.i < len(self.order) else "after the step"
        self.tracker.segment = ""
        self.i = self.i + 1 if self.i < len(self.order) else 0
        return 0

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return 0.0

    def sync(self) -> None:
        pass


class HostBranches(TorchDispatchMode):
    """A branch the step's code takes on the host on a one-element bool tensor that no fake tensor can answer
    (``aten._local_scalar_dense``), taken as False, and counted.  The one kdbench meets: liger's backward
    (``LigerFusedLinearDistillationBase.backward``) tests ``torch.ne(grad_output, 1.0)`` and scales its saved
    gradients when true; the fake run's backward starts from 1.0 (no loss scaler runs in it), so False is the branch
    the step takes."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0

    def answer(self, func, args: tuple) -> bool | None:
        """False where ``func`` reads such a bool on the host (counted), else None: the operator runs.  The planner
        hands this to its meter (``LiveBytes.answer``), which asks it first: one dispatch mode less an operator."""
        if (
            func is torch.ops.aten._local_scalar_dense.default
            and isinstance(args[0], FakeTensor)
            and args[0].dtype == torch.bool
            and args[0].numel() == 1
            and known_values(args[0]) is None
        ):
            self.taken += 1
            return False
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        got = self.answer(func, args)
        return got if got is not None else func(*args, **(kwargs or {}))

    @property
    def note(self) -> str:
        if not self.taken:
            return ""
        return (
            f"{self.taken} host branch(es) on a bool tensor's value taken as False (liger's backward tests "
            "grad_output != 1, which the step's backward, without loss scaling, starts from)"
        )


def fake_run_key(config: CellConfig) -> str:
    """What identifies ``config``'s fake run: its settings but :data:`NOT_IN_FAKE_RUN`'s, as sorted JSON."""
    import json

    fields = config.model_dump(mode="json")
    return json.dumps({k: v for k, v in fields.items() if k not in NOT_IN_FAKE_RUN}, sort_keys=True)


def unpredictable(exc: BaseException) -> str:
    """Why a fake run failed, naming the operator where torch says which."""
    func = getattr(exc, "func", None)
    what = type(exc).__name__
    if func is not None and what in ("DataDependentOutputException", "DynamicOutputShapeException"):
        return f"the fake run cannot run {func}: it reads a tensor's values ({what}), which a fake tensor has not"
    if func is not None:
        return f"the fake run cannot run {func}: it has no shape-only implementation ({what})"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else what
    return f"the fake run failed: {what}: {text[:300]}"


def predict(
    config: CellConfig,
    device_type: str = "cuda",
    allow_imports: bool = False,
    decode_steps: int | None = DECODE_STEPS,
    prime: bool = True,
    shapes: bool = False,
    depth: bool = True,
    phase_peaks: bool = False,
) -> Prediction:
    """The predicted peak of one device (rank 0's) during ``config``'s distillation step; ``device_type`` is the
    device asked about (the host figure depends on it; the fake run is the CPU's); ``allow_imports``: the suite's
    (``module:callable`` models are built); ``decode_steps``: the decode steps an on-policy generation runs, the
    rest extrapolated (:mod:`kdbench.fit.decode`; None: every step, the reference); ``prime``: a cell that
    :func:`primable` takes gets the first step's leftovers made without running it (:func:`prime_first_step`), the
    other cells (and ``prime=False``, the reference) run :data:`STEPS` fake steps; ``shapes``: the census writes
    down each call's shapes (:attr:`kdbench.fit.census.Record.shapes`: for a step timed on the machine itself, at a
    cost of about a quarter of the fake run); ``depth``: a deep LM pair's prediction is extrapolated from fake runs of
    a few layers where :func:`kdbench.fit.depth.depths` allows (False: its every layer run, the reference);
    ``phase_peaks``: each phase's own peak kept, with what it held (:attr:`Prediction.phase_peaks`), and the meter
    (:attr:`Prediction.meter`: what the extrapolation lines up)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    workload = workload_of(config)
    host = workload.host_footprint(config, device_type)
    host_bytes = None if host.unknown else host.rank_bytes(True)
    host_text = host.summary(config.world_size)
    skip = workload.skip_reason(config, CPU)
    if skip:
        return Prediction(None, host_bytes=host_bytes, host=host_text, error=f"not predicted: {skip}")
    if config.parallel == "fsdp" and config.world_size > 1 and _in_process_group():
        return predict_apart(config, device_type, allow_imports)
    if depth:
        from kdbench.fit.depth import by_depth, depths

        layers = depths(config)
        if layers is not None:
            return by_depth(
                predict, config, device_type, allow_imports, layers, decode_steps=decode_steps, shapes=shapes
            )
    start = time.perf_counter()
    tracker = LiveBytes(phases=phase_peaks)
    branches = HostBranches()
    tracker.answer = branches.answer
    redo = False  # a primed run whose step left a parameter without a gradient: predicted again, unprimed
    census = CensusMode(lambda: tracker.phase, config.world_size, shapes)  # the same run's operators: the time
    target = GpuTarget(device_type, tracker)  # a GPU's autocast lists, fused attention and sort workspace
    notes: list[str] = []
    step = None
    try:
        with (
            fake_world(config.world_size if config.parallel == "fsdp" else 1) as dp,
            FakeTensorMode(allow_non_fake_inputs=True) as mode,
            as_measured_batches(),
            tracker,
            census,
            target,
            short_decode(tracker, census, decode_steps) as decoded,
        ):
            # no model kept: a kept one is deep-copied per use, which reads a fake tensor's data pointer; the weights'
            # values are never read: torch's initialisers and the random fills they end in are left undone
            tracker.answer = undrawn
            with skipped_inits():
                teacher, student = workload.step_pair(config, CPU, ModelCache(allow_imports, capacity=0), dp)
            tracker.answer = branches.answer
            tracker.track(_tensors(teacher, student), PARAMETERS)
            with unset_fake_temporarily():  # the batch's values decide shapes: made for real, handed along
                x, y = workload.batch(config, config.batch_size, CPU.device, config.seed, (teacher, student))
            x, y = (with_values(mode.from_tensor(t), t) for t in (x, y))
            tracker.track((x, y), INPUTS)
            # The device's peak is a step's (or a teacher cache's build): what building and sharding the models
            # held on the way (an FSDP2 teacher whole on rank 0's host) is not on the device.
            tracker.reset_peak()
            tracker.start_phases()
            if config.teacher.mode == "offline":  # its stored top-k read: the teacher's weights are not on the device
                for module in teacher.modules():  # (their shapes kept, on meta: nothing counted)
                    for name, p in list(module._parameters.items()):
                        if p is not None:
                            meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
                            module._parameters[name] = torch.nn.Parameter(meta, requires_grad=False)
            live_teacher = config.teacher.mode in ("live", "offline")  # offline: the reader's buffers, in the steps
            tracker.phase = "setup" if live_teacher else "cache build"
            wrap, wrap_teacher = (dp.wrapper(config, CPU), dp.teacher_wrapper(config, CPU)) if dp else (None, None)
            step = DistillStep(
                teacher, student, x, y, config, CPU, workload, wrap=wrap, wrap_teacher=wrap_teacher, diagnostics=False
            )
            if live_teacher:
                tracker.reset_peak()
                tracker.start_phases()
            distiller = step.distiller
            if distiller.scaler is not None:  # its found-inf check reads values; it holds a few scalars
                distiller.scaler = None
                notes.append("fp16's loss scaling not run (a few scalars)")
            target.optimizer(distiller.optimizer, config.optimizer.impl)
            step.clock = _PhaseClock(tracker, distiller.lead_phase)
            for p in distiller.trainee.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: tracker.mark([p.grad], GRADIENTS))
            # what trains (adapters too), and what sharding made of the models (FSDP2's local shards)
            tracker.track(_tensors(distiller.trainee, distiller.model, distiller.teacher), PARAMETERS)
            primed = prime_first_step(tracker, step) if prime and primable(config, step) else None
            steps = 1 if primed is not None else STEPS
            got: set[int] = set()  # the parameters whose gradient the (last) step accumulated
            for p in distiller.trainee.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: got.add(id(p)))
            for i in range(steps):
                census.on = i == steps - 1  # the census is a timed step's: the last, with the optimizer's state
                got.clear()
                step()
                census.on = False
                tracker.mark(_state(distiller.optimizer), OPTIMIZER)
            if primed is not None and got != primed:  # a parameter without a gradient has no state: run it out
                redo = True
            logits = _logits_bytes(distiller.loss_fn, x)
            buckets = ddp_bucket_bytes(config, distiller.trainee)
            reduce = ddp_all_reduce(config, distiller.trainee)
    except Exception as exc:  # any failure of the fake run makes the cell unpredictable, said why
        if os.environ.get("KDBENCH_FIT_DEBUG"):
            raise
        return Prediction(
            None, host_bytes=host_bytes, host=host_text, seconds=time.perf_counter() - start, error=unpredictable(exc)
        )
    finally:
        if step is not None:
            step.close()
    if redo:
        return predict(
            config, device_type, allow_imports, decode_steps, prime=False, shapes=shapes, depth=False,
            phase_peaks=phase_peaks,
        )  # fmt: skip
    notes.extend(target.notes)
    notes.extend(n for n in (decoded.note, branches.note) if n)
    breakdown = tracker.breakdown()
    census.add(reduce)
    if buckets:
        breakdown[GRADIENTS] += buckets
        mib = buckets / 2**20
        notes.append(f"DDP's gradient buckets added ({mib:,.1f} MiB: its reducer cannot run on fake tensors)")
    return Prediction(
        tracker.peak.bytes + buckets,
        phase=tracker.peak.phase,
        breakdown=breakdown,
        logits_bytes=logits,
        host_bytes=host_bytes,
        host=host_text,
        seconds=time.perf_counter() - start,
        notes=tuple(notes),
        census=census.census(),
        phase_peaks={}
        if tracker.resized
        else {p: (b, tracker.phase_breakdown(p)) for p, (b, _) in (tracker.phase_peaks or {}).items()},
        meter=tracker if phase_peaks and not tracker.resized else None,
    )


def primable(config: CellConfig, step: DistillStep) -> bool:
    """Whether the first of :data:`STEPS` fake steps can be left out for :func:`prime_first_step`'s leftovers: one
    device's step that keeps nothing of a step for the next but its gradients, the optimizer's state and (on-policy)
    what its generation keeps (not a cross-tokenizer alignment's or an offline reader's batches; not DDP's buckets or
    FSDP2's shards), updated without a loss scaler."""
    d = step.distiller
    return (
        config.world_size == 1
        and d.paired is None
        and step.offline is None
        and d.scaler is None
        and config.teacher.mode != "offline"
    )


def prime_first_step(tracker: LiveBytes, step: DistillStep) -> set[int] | None:
    """What a first step leaves for the second, made without running it: a zero gradient for every parameter the
    optimizer updates (the second step frees them before its backward, as it frees the first's), its loss (a scalar,
    until the second's replaces it), what the loss keeps of its fixed batch (the LM loss's valid rows) and the
    optimizer's state, made by one update from them (an update of zero gradients: the state's tensors, their shapes
    and dtypes, as the first real update makes them). The peak stays what it was (the update's own temporaries are
    no step's). An on-policy step's generation is run once (what it keeps for the next step: its labels buffer, a
    static KV cache, the generated batch the step remembers as its input). Returns the ids of the parameters primed:
    if the step then leaves one without a gradient (an unused head), its state would be counted that no real step
    makes, and the caller predicts again without priming."""
    optimizer = step.distiller.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return None
    saved = tracker.peak
    tracker.peak = dataclasses.replace(saved, live=list(saved.live))
    saved_phases = None if tracker.phase_peaks is None else dict(tracker.phase_peaks)
    saved_path = None if tracker.trajectory is None else {k: list(v) for k, v in tracker.trajectory.items()}
    distiller, labels = step.distiller, step.y
    if distiller.on_policy is not None:  # the first step's generation: what it keeps, made as it makes it
        x, labels = distiller.on_policy(step.x, step.y)
        distiller.last_input, distiller.last_student_input, distiller.last_extra = x, x, {}
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
    tracker.mark([p.grad for p in params], GRADIENTS)
    optimizer.step()
    tracker.mark(_state(optimizer), OPTIMIZER)
    if step.last_loss is None:  # the first step's loss, kept until the second's replaces it (a float32 scalar)
        step.last_loss = torch.zeros((), dtype=torch.float32)
    valid_rows = getattr(distiller.loss_fn, "valid_rows", None)
    if valid_rows is not None:  # the LM loss finds its fixed batch's (or labels buffer's) valid tokens once
        valid_rows(labels)
    tracker.peak = saved  # a new peak is taken from here on, what priming left included
    tracker.phase_peaks, tracker.trajectory = saved_phases, saved_path
    return {id(p) for p in params}


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """Rank 0 of a fake process group of ``world_size`` ranks (:class:`~kdbench.measure.parallel.DataParallel`;
    None for one device): torch's ``fake`` backend, whose collectives move nothing, so that FSDP2 shards and DDP
    buckets are made as on a real rank.  Not inside a process group this process already belongs to (a run's
    worker): :func:`predict_apart` runs the prediction in a process of its own then."""
    if world_size <= 1:
        yield None
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from kdbench.measure.parallel import DataParallel, cell_mesh

    if dist.is_initialized():
        raise RuntimeError("a data-parallel cell is predicted in a process outside any process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dp = DataParallel()
        dp._cell["mesh"] = cell_mesh(None, "cpu")  # before the fake mode: the mesh reads its ranks' values
        yield dp
    finally:
        dist.destroy_process_group()


def ddp_bucket_bytes(config: CellConfig, trainee: torch.nn.Module) -> int:
    """What DDP holds beyond one device's step (a DDP cell is predicted as one device's step plus this): its
    gradient buckets, one flat copy of every trainable parameter's gradient, made when the model is wrapped and
    kept; none with ``ddp.gradient_as_bucket_view``, where the gradients are views into them (DDP's C++ reducer
    cannot run on fake tensors)."""
    if config.world_size <= 1 or config.parallel == "fsdp" or config.ddp.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in trainee.parameters() if p.requires_grad)


def ddp_all_reduce(config: CellConfig, trainee: torch.nn.Module) -> list:
    """DDP's all-reduce of the trainable gradients, in buckets of ``ddp.bucket_cap_mb``, as census records (its
    reducer cannot run on fake tensors); none for one device or FSDP2 (whose collectives the fake run sees)."""
    if config.world_size <= 1 or config.parallel == "fsdp":
        return []
    grads = [p for p in trainee.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in grads)
    if not nbytes:
        return []
    buckets = -(-nbytes // int(config.ddp.bucket_cap_mb * 2**20))
    return [all_reduce_record(nbytes, grads[0].dtype, buckets)]


def _tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _logits_bytes(loss: Any, x: torch.Tensor) -> int | None:
    count = getattr(loss, "logits_memory", None)
    found = count(x.numel())["bytes"] if count is not None else None
    return int(found) if found is not None else None  # None: not counted (uld, a divergence without counts)


_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC")


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def predict_apart(
    config: CellConfig, device_type: str = "cuda", allow_imports: bool = False, timeout_s: float = 600.0
) -> Prediction:
    """:func:`predict` in a Python process of its own (``python -m kdbench.fit.planner``): an FSDP2 cell's fake
    process group cannot be made inside a process group this process is already a rank of (a run's worker)."""
    import json
    import subprocess
    import sys

    request = json.dumps(
        {"config": config.model_dump(mode="json"), "device_type": device_type, "allow_imports": allow_imports}
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kdbench.fit.planner"],
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={k: v for k, v in os.environ.items() if not k.startswith(_RANK_VARIABLES)},
        )
    except subprocess.TimeoutExpired:
        return Prediction(None, error=f"the fake run took over {timeout_s:.0f} s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Prediction(None, error=f"the fake run's process failed (exit {proc.returncode}): {tail[:300]}")
    fields = json.loads(lines[-1])
    fields["notes"] = tuple(fields.get("notes", ()))
    fields["census"] = Census.from_json(fields["census"]) if fields.get("census") else None
    return Prediction(**fields)


def _main() -> None:
    import dataclasses
    import json
    import sys

    request = json.loads(sys.stdin.read())
    config = CellConfig.model_validate(request["config"])
    prediction = predict(config, request["device_type"], request.get("allow_imports", False))
    print(json.dumps(dataclasses.asdict(prediction)))


if __name__ == "__main__":
    _main()
