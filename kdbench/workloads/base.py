"""The workload interface: what one family of teacher/student pairs does differently.

Each family (:mod:`.vision`, :mod:`.lm`, :mod:`.encoder`) implements :class:`Workload` once, as a stateless
object; :func:`kdbench.workloads.registry.workload_of` picks a cell's.  The cell orchestrator
(:mod:`kdbench.run.cell`) looks it up once and hands it down: to the distillation step
(:class:`kdbench.distill.step.StepFamily`: feature paths, loss, on-policy batch, compact teacher), to the step's
measurement (:class:`kdbench.measure.step.StepWorkload`: batch, tokens, the family's step columns) and to the
serving measurements (:meth:`Workload.serve`).  The settings only some families take are declared in
:attr:`Workload.takes` and refused for the others from one table (:data:`kdbench.workloads.registry.FAMILY_SETTINGS`).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.names import Measurement, role_of
from kdbench.core.schema import Row
from kdbench.hw.backends import Backend
from kdbench.models import ModelCache
from kdbench.workloads.placement import EVERY, STEP, HostFootprint, ModelBuild, model_copies

Problems = list[tuple[tuple[str, ...], str]]
Pair = tuple[nn.Module, nn.Module]


class Workload:
    """What one family of pairs does differently."""

    family: ClassVar[str] = ""
    # a pair of this family and its pairs, as messages name them ("an image pair", "image pairs")
    a_pair: ClassVar[str] = ""
    pairs: ClassVar[str] = ""
    # the family-specific settings this family takes (keys of registry.FAMILY_SETTINGS); the others are refused
    takes: ClassVar[frozenset[str]] = frozenset()
    # what the suite's quality block trains this family on: "images", "text", or "" (no quality protocol)
    quality_data: ClassVar[str] = ""
    # what a cell of this family needs beyond the schema's defaults when only its pair is given (`kdbench fit --pair`)
    cell_defaults: ClassVar[dict[str, Any]] = {}

    # ------------------------------------------------------------------ plan time

    def check(self, config: CellConfig, allow_imports: bool) -> Problems:
        """What cannot run in the cell, as (setting path, message), found without building anything heavy: the
        models, the inputs they take, the methods of this family.  Settings of other families are refused apart
        (:func:`kdbench.workloads.registry.refusals`)."""
        raise NotImplementedError

    def planned(self, config: CellConfig) -> list[tuple[Measurement, int]]:
        """(measurement, batch size) of every row the cell produces, the step first."""
        raise NotImplementedError

    def config_columns(self, config: CellConfig) -> Row:
        """The config columns only this family fills (the others stay empty on its rows)."""
        raise NotImplementedError

    def tokens(self, measurement: Measurement, batch_size: int, config: CellConfig) -> int | None:
        """Tokens one timed call processes (None: not a token workload)."""
        return None

    def skip_reason(self, config: CellConfig, backend: Backend) -> str | None:
        """Why the cell cannot run in this environment (a package or an API it needs is missing), with the fix;
        None: it can.  The cell's rows are then stored as skipped, saying so."""
        return None

    # ------------------------------------------------------------------ the models

    def build_pair(self, config: CellConfig, backend: Backend, cache: ModelCache) -> Pair:
        """Fresh copies of the teacher and the student, on the device, as serving uses them."""
        raise NotImplementedError

    def step_pair(self, config: CellConfig, backend: Backend, cache: ModelCache, dp: Any = None) -> Pair:
        """The pair the distillation step trains, on this rank of ``dp`` (a
        :class:`kdbench.measure.parallel.DataParallel`; None: one device); by default :meth:`build_pair`'s."""
        return self.build_pair(config, backend, cache)

    def step_keeps_pair(self, config: CellConfig) -> bool:
        """Whether serving can measure the pair the step trained (False: the step changed it in place, e.g.
        sharded it; the orchestrator frees it and builds whole copies for serving)."""
        return True

    def host_footprint(self, config: CellConfig, device_type: str) -> HostFootprint:
        """What the cell's models take of the host per rank on ``device_type`` (``cpu``, or a GPU's), counted without
        building them (:class:`kdbench.workloads.placement.HostFootprint`).  By default (image classifiers): each
        model's float32 master in the worker's cache and the fresh copy the cell uses (moved to the device on a
        GPU), from its registered parameter count; a ``module:callable`` is not counted before it is built."""
        copies = []
        for role in ("teacher", "student"):
            name = getattr(config.pair, role)
            params = _classifier_params(name, config.data.num_classes, tuple(config.data.shape))
            if params is None:
                return HostFootprint(unknown=f"the {role} {name} is user code: its size is known once it is built")
            build = ModelBuild(role, "device", "fp32")
            copies += model_copies(f"{role} {name}", params, 0, build, True, device_type, EVERY, STEP)
        return HostFootprint(tuple(copies), fix="free host memory or run it on a machine with more")

    def model_key(self, config: CellConfig, role: str) -> tuple:
        """What makes the cell's ``role`` model the same model as another cell's (the quality protocol trains
        each once): its name, precision and what it is built from (here: its config overrides; the quality
        block sets its input)."""
        overrides = repr(sorted(self.model_overrides(config, role).items()))
        return getattr(config.pair, role), (), config.precision, overrides

    def model_overrides(self, config: CellConfig, role: str) -> dict[str, Any]:
        """The config overrides the ``role`` model is built with (none for families built by name alone)."""
        return {}

    def layer_stacks(self, config: CellConfig) -> tuple[int, int] | None:
        """The teacher's and the student's layer counts where both are stacks of alike layers that a config
        override of ``num_hidden_layers`` cuts (:mod:`kdbench.fit.depth` extrapolates such a cell's prediction in
        depth); None for a family without such stacks."""
        return None

    # ------------------------------------------------------------------ the step

    def batch(
        self, config: CellConfig, batch_size: int, device: torch.device, seed: int, models: Pair
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One fixed, seeded batch for the built pair ``models``: the models' input and the targets of the loss."""
        raise NotImplementedError

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: CellConfig) -> Any:
        """The paired module paths feature methods tap (:class:`kdbench.distill.hooks.FeaturePaths`)."""
        raise NotImplementedError

    def loss(self, config: CellConfig, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Backend):
        """The cell's whole loss: ``loss(LossInputs) -> scalar``; the model outputs it gets are the models'
        forwards' (logits for classifiers, final hidden states for LMs and encoders)."""
        raise NotImplementedError

    def compact_teacher(self, distiller: Any, outputs: Any, targets: torch.Tensor) -> tuple[Any, Row, Any]:
        """The teacher's outputs of the fixed batch in the workload's compact form (``teacher.mode`` other than live
        and cached), the columns that describe it, and a call returning the columns of what it loses (or None): a
        diagnostic, called after the build is timed (``teacher_cache_ms`` is the build alone)."""
        raise NotImplementedError(f"teacher.mode {distiller.config.teacher.mode} is not for {self.family} pairs")

    def offline_teacher(self, distiller: Any, config: CellConfig, run_dir: str | None, dp: Any = None) -> Any:
        """``teacher.mode: offline``: the step's reader of the teacher's stored outputs, ``() -> (x, y, teacher)``,
        with ``columns()`` and ``close()`` (its store built first where it is missing; ``dp``: a data-parallel
        cell's rank)."""
        raise NotImplementedError(f"teacher.mode offline is not for {self.family} pairs")

    def on_policy(self, distiller: Any, config: CellConfig):
        """``(x, y) -> (x, y)``: the batch an on-policy step trains on, generated by the student at the start of
        each step (its own phase); None: the step trains on the fixed batch."""
        return None

    def paired_batch(self, distiller: Any, config: CellConfig):
        """``(x, y) -> (student x, student y, teacher x, the loss's extra inputs)``: each model's own tokens of
        the batch, made at the start of each step (its own phase); None: both models read the fixed batch."""
        return None

    def plan_notes(self, config: CellConfig) -> list[str]:
        """What the plan says of a cell it runs (not a mistake: a choice the user may not have meant)."""
        return []

    def step_columns(self, step: Any, config: CellConfig, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]:
        """The step row's columns only this family has, and notes."""
        raise NotImplementedError

    # ------------------------------------------------------------------ serving

    def serve(
        self,
        measurement: Measurement,
        batch_size: int,
        pair: Pair,
        config: CellConfig,
        backend: Backend,
        budget_s: float | None,
    ) -> Row:
        """One serving measurement's row (the step is measured by :mod:`kdbench.measure.step`, the same for every
        family), timed within ``budget_s``."""
        raise NotImplementedError


@functools.lru_cache(maxsize=256)
def _classifier_params(name: str, num_classes: int, shape: tuple[int, ...]) -> int | None:
    """Parameters of registered image classifier ``name`` (None: user code, or a model that cannot be counted)."""
    if ":" in name:
        return None
    from kdbench.models.registry import parameter_count

    try:
        return parameter_count(name, num_classes, shape)
    except Exception:  # a model the meta device cannot build is counted once it is built
        return None


def encoder_methods(methods: list, pair_is: str) -> Problems:
    """The problem of encoder methods (``minilm``) on a pair that is not two encoders (``pair_is``: what it is)."""
    encoder = [m.name for m in methods if m.cls.domain == "encoder"]
    if not encoder:
        return []
    why = f"{', '.join(encoder)}: an encoder method; it distils BERT-shaped encoders: pair two encoders"
    return [(("method",), f"{why} (`kdbench list models`), not {pair_is}")]


def config_problem(role: str, overrides: dict, exc: Exception) -> tuple[tuple[str, ...], str]:
    """A model config that cannot be built, at the key to change: ``overrides.ROLE`` when an override is at fault,
    else ``pair.ROLE``."""
    key = ("overrides", role) if overrides and "override" in str(exc) else ("pair", role)
    return key, str(exc)


def serving_plan(
    config: CellConfig, student: tuple[Measurement, ...], teacher: tuple[Measurement, ...]
) -> list[tuple[Measurement, int]]:
    """(measurement, batch size) of every row of a cell: the step, then at each inference batch size the
    ``student`` measurements and (with ``inference.teacher``) the ``teacher``'s."""
    out = [(Measurement.DISTILL_STEP, config.batch_size)]
    for bs in config.inference.batch_sizes:
        out += [(m, bs) for m in student]
        if config.inference.teacher:
            out += [(m, bs) for m in teacher]
    return out


def model_of(measurement: Measurement, pair: Pair) -> tuple[str, nn.Module]:
    """The role a serving measurement measures and that model of ``pair``."""
    role = role_of(measurement)
    return role, pair[0] if role == "teacher" else pair[1]


SERVED_PRECISION = "the teacher is served at precision"  # how served_precision_note begins


def served_precision_note(measurement: Measurement, config: CellConfig) -> str:
    """A teacher's serving row where the cell's ``teacher_precision`` is not its ``precision``: served at
    ``precision``, as the student is, so that ``speedup_vs_teacher`` compares the two models at one precision (and
    a teacher's serving row is the same measurement in every cell that serves it: the reuse key).  One note with no
    ``"; "`` in it, which :func:`restate_served_precision` finds in a row's joined notes."""
    if role_of(measurement) != "teacher" or config.teacher_precision == config.precision:
        return ""
    return (
        f"{SERVED_PRECISION} {config.precision}, as the student is, so that speedup_vs_teacher compares the models "
        f"at one precision (teacher_precision {config.teacher_precision} is the teacher's in the distillation step)"
    )


def restate_served_precision(notes: str | None, measurement: Measurement, config: CellConfig) -> str | None:
    """The joined ``notes`` (``"; "``) of a teacher row measured in another cell, reused in the cell of ``config``:
    the measuring cell's :func:`served_precision_note` replaced by this cell's (the reuse key holds ``precision``,
    not ``teacher_precision``, so the two cells may differ in it)."""
    kept = [n for n in (notes or "").split("; ") if n and not n.startswith(SERVED_PRECISION)]
    mine = served_precision_note(measurement, config)
    return "; ".join([*kept, mine] if mine else kept) or None
