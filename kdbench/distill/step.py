"""One distillation step: frozen teacher forward, student forward, loss, backward, update.

``Distiller`` holds what a cell trains with: the frozen teacher, the ``Trainee``
(student plus the adapters feature methods train with it), the loss, optimizer and
precision choices.  ``Distiller.train_step(x, y)`` is one step on any batch (the
quality runs use it); ``DistillStep`` is the timed callable on one fixed batch,
with the teacher run live or its outputs cached once.

Phases.  When given a clock, a step stamps the boundaries of its five phases
(:data:`kdbench.core.names.PHASES`) with that clock — device events on GPUs, ``perf_counter_ns`` on the
CPU — in the same pass that is timed.  Events are only read after the timed loop,
so recording them adds no host-device synchronisation; on the CPU a stamp costs
well under a microsecond.  ``DistillStep.phase_ms`` turns the stamps of the timed
iterations into per-phase samples.

Clean-up.  ``Distiller.close()`` removes the feature hooks and frees the gradients, so
nothing a finished step held (hooks, gradients, optimizer state) inflates the memory
peak of the next measurement in the same worker (torchdistill's ``clean_modules``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from kdbench.config.optimizer import OptimizerConfig
from kdbench.config.schema import CellConfig
from kdbench.core.names import ALIGN, GENERATE, PHASES, TEACHER_READ
from kdbench.distill.hooks import FeaturePaths, FeatureTap
from kdbench.distill.losses import LossInputs, needs_features
from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast, grad_scaler, math_mode
from kdbench.hw.clock import Clock
from kdbench.hw.layout import place_aligned, place_model


class StepFamily(Protocol):
    """What a distillation step asks of the pair's family (:class:`kdbench.workloads.base.Workload` is one): the
    caller looks the family up and hands it in; the step never asks which family it is."""

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: CellConfig) -> Any:
        """The paired module paths the feature methods tap (:class:`kdbench.distill.hooks.FeaturePaths`)."""

    def loss(self, config: CellConfig, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Backend):
        """The cell's whole loss, ``loss(LossInputs) -> scalar``."""

    def on_policy(self, distiller: Distiller, config: CellConfig) -> Callable | None:
        """``(x, y) -> (x, y)``: the batch an on-policy step trains on; None: the fixed batch."""

    def paired_batch(self, distiller: Distiller, config: CellConfig) -> Callable | None:
        """``(x, y) -> (student x, student y, teacher x, the loss's extra inputs)``: a step whose models read the
        batch each in its own tokens (its ``align`` phase, :data:`kdbench.core.names.ALIGN`); None: both read ``x``."""

    def compact_teacher(
        self, distiller: Distiller, outputs: Any, targets: torch.Tensor
    ) -> tuple[Any, dict, Callable[[], dict] | None]:
        """The teacher's outputs of the fixed batch in the family's compact form, the columns that say so, and its
        diagnostics (columns of what the form loses; None: none), called once the build is timed."""

    def offline_teacher(self, distiller: Distiller, config: CellConfig, run_dir: str | None, dp: Any = None) -> Any:
        """``teacher.mode: offline``: ``(x, y) -> (x, y, the stored teacher outputs)``, the next batch read ahead (the
        fixed batch is ignored but by a fit's fake run), with ``columns()`` and ``close()``; ``dp``: a data-parallel
        cell's rank (rank 0 builds the store, each rank reads its own batches)."""


def make_optimizer(params, cfg: OptimizerConfig, fused: bool = False) -> torch.optim.Optimizer:
    """The student's optimizer in ``cfg.impl``: torch's default choice, ``foreach`` (one multi-tensor kernel
    per operation) or ``fused`` (one kernel per step); ``fused`` asks for the fused one whatever ``cfg.impl``
    says (a GPU GradScaler needs it to skip its host sync)."""
    kwargs: dict[str, Any] = {} if cfg.weight_decay is None else {"weight_decay": cfg.weight_decay}
    if fused or cfg.impl == "fused":
        kwargs["fused"] = True
    elif cfg.impl == "foreach":
        kwargs["foreach"] = True
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, **kwargs)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, **kwargs)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, **kwargs)


def compile_mode(setting: str) -> str | None:
    """torch.compile's ``mode`` for a cell's ``compile`` setting ("off" with compile_teacher: the default)."""
    return None if setting in ("off", "default") else setting


CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # compile modes that replay CUDA graphs (graph trees)


def step_marker() -> Callable[[], None] | None:
    """``torch.compiler.cudagraph_mark_step_begin`` where this torch has it (None where not).

    CUDA graph trees start a new iteration at every compiled call with no backward pending, freeing the
    previous iteration's outputs: the student's call would overwrite the compiled teacher's still-live
    logits ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
    Marking the step's start makes teacher and student one iteration; without the API the teacher's
    outputs are cloned instead."""
    return getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)


def backward_and_update(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    between: Callable[[], Any] | None = None,
) -> None:
    """Backward, then the optimizer step: through the GradScaler when there is one (fp16), which
    scales the loss and skips an update whose gradients are not finite.  ``between`` runs after
    the backward (the step's phase stamp)."""
    if scaler is not None:
        scaler.scale(loss).backward()
        if between is not None:
            between()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if between is not None:
            between()
        optimizer.step()


def freeze(teacher: nn.Module) -> nn.Module:
    """eval() (batch-norm statistics stay put) and no gradients; no optimizer ever sees it."""
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


@dataclass
class TeacherOutputs:
    logits: torch.Tensor
    feats: list[torch.Tensor]


class Trainee(nn.Module):
    """The student and its adapters: everything that trains, as one module (DDP wraps this).

    ``forward`` returns the logits, the student's captured features and each
    adapter's output on its feature.
    """

    def __init__(self, student: nn.Module, tap: FeatureTap | None, adapters: dict[str, tuple[int, nn.Module]]):
        super().__init__()
        self.student = student
        self.adapters = nn.ModuleDict({name: module for name, (_, module) in adapters.items()})
        self.adapter_index = {name: index for name, (index, _) in adapters.items()}
        self.tap = tap  # hooks on the student's feature modules (not a module: nothing to register)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        logits = self.student(x)
        feats = self.tap.take() if self.tap is not None else []
        adapted = {name: self.adapters[name](feats[i]) for name, i in self.adapter_index.items()}
        return logits, feats, adapted


def _dry_features(model: nn.Module, tap: FeatureTap, example: torch.Tensor) -> list[torch.Size]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(example)
        return [f.shape for f in tap.take()]
    finally:
        model.train(was_training)


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def count(self, *_: Any) -> None:
        self.n += 1


class Distiller:
    """A cell's training setup; ``train_step`` runs one distillation step on a batch."""

    def __init__(
        self,
        teacher: nn.Module,
        student: nn.Module,
        config: CellConfig,
        backend: Backend,
        example: torch.Tensor,
        workload: StepFamily,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        wrap_teacher: Callable[[nn.Module], nn.Module] | None = None,
    ):
        self.config = config
        self.fixed_input = example  # the batch the Distiller was built for (a cross-tokenizer step needs it)
        self.teacher = freeze(teacher)
        if wrap_teacher is not None:  # FSDP2 cells: the frozen teacher sharded too (in place)
            self.teacher = teacher = wrap_teacher(self.teacher)
        self.device_type = backend.device_type
        self.student_ac: AutocastChoice = choose_autocast(backend, config.precision)
        self.teacher_ac: AutocastChoice = choose_autocast(backend, config.teacher_precision)
        self._switch_math = self.teacher_ac.tf32 != self.student_ac.tf32
        self.paths: FeaturePaths | None = None
        self.t_tap = s_tap = None
        shapes = None
        self.workload = workload
        if needs_features(config.method):
            example = example[: min(2, len(example))]
            self.paths = workload.feature_paths(teacher, student, example, config)
            self.t_tap = FeatureTap(teacher, self.paths.teacher, "teacher")
            s_tap = FeatureTap(student, self.paths.student, "student")
            shapes = FeaturePaths(
                teacher=_dry_features(teacher, self.t_tap, example),  # type: ignore[arg-type]
                student=_dry_features(student, s_tap, example),
            )
        with torch.random.fork_rng(devices=[]):  # adapters start from the cell's seed, whatever ran before
            torch.manual_seed(config.seed)
            self.loss_fn = workload.loss(config, shapes, teacher, student, backend)
        adapters = {
            name: term.adapter()
            for name, term in zip(self.loss_fn.names, self.loss_fn.terms)
            if term.adapter() is not None
        }
        self.trainee = Trainee(student, s_tap, adapters)  # type: ignore[arg-type]
        place_model(self.trainee.adapters, example.device, config.memory_format, len(config.data.shape) == 3)
        self.trainee.train()
        self.model = wrap(self.trainee) if wrap is not None else self.trainee
        self._teacher = self.teacher
        if config.compile != "off":  # the student's forward and backward (AOTAutograd); loss and update stay eager
            self.model = torch.compile(self.model, mode=compile_mode(config.compile))
        if config.compile_teacher:
            self._teacher = torch.compile(self.teacher, mode=compile_mode(config.compile))
        graphed = config.compile in CUDAGRAPH_MODES and backend.device_type == "cuda"
        self._mark_step = step_marker() if graphed else None
        self._clone_teacher = graphed and config.compile_teacher and self._mark_step is None
        self.on_policy = workload.on_policy(self, config)  # (x, y) -> the generated batch, or None
        paired = getattr(workload, "paired_batch", None)  # (x, y) -> each model's own tokens, or None
        self.paired = paired(self, config) if paired is not None else None
        # the phase the step begins with, before PHASES (the plan never gives a cell both)
        self.lead_phase = GENERATE if self.on_policy is not None else ALIGN if self.paired is not None else None
        self.offline: Callable | None = None  # (x, y) -> (x, y, stored top-k): an offline teacher's (DistillStep)
        self.last_input = example
        self.scaler = grad_scaler(backend, self.student_ac)
        self.optimizer, self.optimizer_note = self._optimizer(config, backend)
        self.steps = 0  # train_step calls (DKD's warm-up counts them)
        # Updates actually applied (a GradScaler skips those with inf/NaN gradients).  The hook holds the
        # counter, not this Distiller: no reference cycle keeps a finished cell's tensors alive.
        self._updates = _Counter()
        self.optimizer.register_step_post_hook(self._updates.count)
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=example.device)

    def _optimizer(self, config: CellConfig, backend: Backend) -> tuple[torch.optim.Optimizer, str]:
        """With a GradScaler on a GPU, a non-fused optimizer makes the scaler read found_inf on the host every
        step (a host-device sync bf16 and fp32 steps do not have); a fused one checks it on the device."""
        params = list(self.trainee.parameters())
        if self.scaler is None or backend.device_type != "cuda" or config.optimizer.impl != "default":
            return make_optimizer(params, config.optimizer), ""  # an asked-for impl is kept, sync or not
        try:
            optimizer = make_optimizer(params, config.optimizer, fused=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            note = f"the GradScaler syncs host and device every step: no fused {config.optimizer.name} here ({why})"
            return make_optimizer(params, config.optimizer), note
        return optimizer, f"fused {config.optimizer.name}, so the GradScaler's step needs no host-device sync"

    @property
    def optimizer_steps(self) -> int:
        return self._updates.n

    @property
    def student(self) -> nn.Module:
        return self.trainee.student

    @property
    def adapter_params(self) -> int:
        return sum(p.numel() for p in self.trainee.adapters.parameters())

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose loss was inf or NaN (read once, after the timed loop: it syncs)."""
        return int(self._nonfinite.item())

    @property
    def scaler_skips(self) -> int:
        return self.steps - self.optimizer_steps if self.scaler is not None else 0

    def close(self) -> None:
        """Remove the feature hooks and free the gradients (the models may be measured again)."""
        for tap in (self.t_tap, self.trainee.tap):
            if tap is not None:
                tap.remove()
        self.optimizer.zero_grad(set_to_none=True)

    def teacher_outputs(self, x: torch.Tensor) -> TeacherOutputs:
        # The step runs in the student's fp32 math mode (set around the measurement); a teacher at
        # another (tf32 vs IEEE) switches for its forward alone: host-side flags, no device work.
        math = math_mode(self.teacher_ac.tf32) if self._switch_math else contextlib.nullcontext()
        with torch.no_grad(), self.teacher_ac.context(self.device_type), math:
            logits = self._teacher(x)
        feats = self.t_tap.take() if self.t_tap is not None else []
        if self._clone_teacher:  # CUDA-graph outputs the student's graphs would overwrite (see step_marker)
            logits, feats = logits.clone(), [f.clone() for f in feats]
        return TeacherOutputs(logits, feats)

    def train_step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        cached: TeacherOutputs | None = None,
        clock: Clock | None = None,
        marks: list | None = None,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step; with `clock`, the six phase-boundary stamps are appended to `marks`.  ``indices``: the
        batch's sample indices in its data set (quality training; methods with a memory bank use them)."""
        stamp = (lambda: marks.append(clock.stamp())) if clock is not None and marks is not None else (lambda: None)
        if self._mark_step is not None:  # one CUDA-graph-tree iteration per step (see step_marker)
            self._mark_step()
        stamp()
        teacher_x, extra = x, {}
        if self.on_policy is not None:  # the student generates the completions the step trains on
            x, y = self.on_policy(x, y)
            teacher_x = x
            stamp()
        elif self.paired is not None:  # each model's own tokens of the batch's text, and their alignment
            x, y, teacher_x, extra = self.paired(x, y)
            stamp()
        elif self.offline is not None:  # the next batch and its teacher top-k, read ahead from the store
            x, y, topk = self.offline(x, y)
            teacher_x, cached = x, TeacherOutputs(topk, [])
            stamp()
        self.last_input = teacher_x  # the teacher's input (FLOPs are counted on it)
        self.last_student_input, self.last_extra = x, extra  # the student's, and its loss's extra inputs (ledger)
        t = cached if cached is not None else self.teacher_outputs(teacher_x)
        stamp()
        with self.student_ac.context(self.device_type):
            s_logits, s_feats, adapted = self.model(x)
        stamp()
        loss = self.loss_fn(LossInputs(s_logits, t.logits, y, s_feats, t.feats, adapted, self.steps, indices, **extra))
        stamp()
        self.optimizer.zero_grad(set_to_none=True)
        backward_and_update(loss, self.optimizer, self.scaler, between=stamp)
        stamp()
        self.steps += 1
        loss = loss.detach()
        self._nonfinite += (~torch.isfinite(loss)).long()
        return loss


class DistillStep:
    """Callable that performs one full step on a fixed batch.

    The loss of the last call is kept as a tensor (`last_loss`), so the timed loop
    never waits on the device to read it.  With ``teacher.mode: cached`` the
    teacher's outputs for the batch are computed once here (``cache_ms``), placed
    at the cell's alignment, and every step runs the student alone.
    """

    def __init__(
        self,
        teacher: nn.Module,
        student: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        config: CellConfig,
        backend: Backend,
        workload: StepFamily,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        phases: bool = True,
        wrap_teacher: Callable[[nn.Module], nn.Module] | None = None,
        diagnostics: bool = True,
        run_dir: str | None = None,
        dp: Any = None,
    ):
        self.distiller = Distiller(teacher, student, config, backend, x, workload, wrap, wrap_teacher)
        self.x, self.y = x, y
        self.config = config
        self.clock = backend.clock() if phases else None
        self.marks: list[list] = []
        self.cache: TeacherOutputs | None = None
        self.cache_ms: float | None = None
        self.cache_columns: dict = {}  # what the cache's workload reports of it (the top-k cache's size and loss)
        self.offline: Any = None  # teacher.mode offline: the store and its reader (the workload's)
        if config.teacher.mode == "offline":  # the store built (or resumed) here, read ahead by a thread each step
            self.offline = workload.offline_teacher(self.distiller, config, run_dir, dp)
            self.distiller.offline, self.distiller.lead_phase = self.offline, TEACHER_READ
        elif config.teacher.mode != "live":
            # In the step's fp32 math mode (the teacher's own where it differs), as the live teacher runs: torch's
            # default would run NVIDIA's fp32 convolutions in TF32.  Host time between synchronizations: a one-off
            # cost is what a user waits for.
            backend.synchronize()
            start = time.perf_counter()
            diagnose = None
            with math_mode(self.distiller.student_ac.tf32):
                out = self.distiller.teacher_outputs(x)
                # copies (place_aligned copies): they outlive a compiled teacher's CUDA-graph output buffers
                feats = [place_aligned(f, config.alignment) for f in out.feats]
                if config.teacher.mode == "cached":
                    self.cache = TeacherOutputs(place_aligned(out.logits, config.alignment), feats)
                else:  # the workload's compact form (topk_cache: the top-k next tokens of an LM)
                    workload = self.distiller.workload
                    compact, self.cache_columns, diagnose = workload.compact_teacher(self.distiller, out, y)
                    self.cache = TeacherOutputs(compact, feats)
            backend.synchronize()
            self.cache_ms = (time.perf_counter() - start) * 1e3
            # what the compact form loses, measured after its build is timed (host syncs); not in a fit's fake run
            if diagnose is not None and diagnostics:
                self.cache_columns.update(diagnose())
        self.last_loss: torch.Tensor | None = None

    def __call__(self) -> None:
        marks: list = []
        self.last_loss = self.distiller.train_step(self.x, self.y, self.cache, self.clock, marks)
        if self.clock is not None:
            self.marks.append(marks)

    def phase_ms(self, n: int) -> dict[str, list[float]]:
        """Per-phase times (ms) of the last `n` calls (the timed ones); read after the loop."""
        if self.clock is None or n == 0:
            return {}
        self.clock.sync()
        out: dict[str, list[float]] = {p.name: [] for p in PHASES}
        for marks in self.marks[-n:]:
            lead = self.distiller.lead_phase  # on-policy and cross-tokenizer steps: one more, first
            phases = PHASES if len(marks) == len(PHASES) + 1 or lead is None else (lead, *PHASES)
            for phase, start, end in zip(phases, marks, marks[1:]):
                out.setdefault(phase.name, []).append(self.clock.elapsed_ms(start, end))
        return out

    def close(self) -> None:
        """Free what the step holds beyond its models: hooks, gradients, cached outputs, stamps."""
        self.distiller.close()
        if self.offline is not None:
            self.offline.close()
            self.distiller.offline = self.offline = None
        self.cache = None
        self.last_loss = None
        self.marks.clear()
