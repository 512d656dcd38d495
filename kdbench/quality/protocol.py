"""Quality: does a distilled student learn?  Accuracy, agreement and time to quality on real data.

A suite may opt in with ``quality: {dataset: digits, epochs: 20, seeds: 3, target: 0.95}``.
For each seed the protocol trains, from scratch and with fixed seeds,

* each distinct **teacher** with cross-entropy (``quality_role: teacher``);
* each distinct **student** with cross-entropy alone (``scratch``), once per seed;
* the student distilled from that seed's trained teacher with each method the suite
  plans (``distilled``), through the same ``Distiller.train_step`` the timed cells use.

All of them follow one recipe (``QualityConfig``: optimizer, learning rate with a
cosine schedule over every step, batch size, epochs; :mod:`kdbench.quality.train`)
and, within a seed, see the mini-batches in the same order.  A scratch student and a
distilled student of one seed start from identical weights; the teacher starts from
other ones (a student of the teacher's architecture would otherwise be trained into
the teacher itself).

Each trained model gives one row (``ROW_KEYS``):

* ``accuracy``: top-1 on the test split after the last epoch; ``best_accuracy``: the
  best epoch's.
* ``agreement``: the fraction of test samples where the student predicts the class
  its seed's teacher predicts (both after the last epoch).
* ``time_to_target_s``: training wall time (``perf_counter``, the device synchronised
  before reading it) accumulated until the end of the first epoch whose accuracy is
  at least ``target`` x that seed's teacher accuracy (MLPerf training's time to
  quality, at epoch granularity); ``None`` when never reached.  For a teacher row the
  threshold is ``target`` x its own final accuracy (always reached, at the latest in
  the last epoch): how fast the teacher itself gets there.
* ``train_time_s``: all training wall time; ``epochs_to_target``: the epoch (1-based).

:func:`quality_plan` lists the rows before anything trains, so a quality job that dies
is stored as exactly the rows it would have produced, each marked failed.

Language-model pairs on text (``dataset: python-stdlib``) follow the same plan, seeds and
recipe: :class:`kdbench.quality.text.TextRun` is this module's ``_Run`` with the text data,
the byte-vocabulary models, next-byte cross-entropy and a record of held-out perplexity
(time to quality: the perplexity at most the teacher's / ``target``).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kdbench.config.schema import TEXT_DATASETS, CellConfig, QualityConfig, TeacherConfig
from kdbench.distill.losses import method_parts
from kdbench.distill.step import Distiller, make_optimizer
from kdbench.hw.backends import Backend, choose_autocast, math_mode
from kdbench.hw.layout import memory_format_of, place_model
from kdbench.measure.failures import error_text
from kdbench.models import ModelCache
from kdbench.names import Measurement, Status
from kdbench.quality.datasets import Dataset, load_dataset
from kdbench.quality.train import DeviceData, Trained, ce_step, fit
from kdbench.schema import Row
from kdbench.workloads import workload_of

logger = logging.getLogger(__name__)

ROW_KEYS = (
    "measurement",
    "status",
    "error",
    "quality_role",
    "teacher",
    "student",
    "teacher_overrides",
    "student_overrides",
    "method",
    "seed",
    "quality_dataset",
    "quality_epochs",
    "quality_target",
    "accuracy",
    "best_accuracy",
    "agreement",
    "time_to_target_s",
    "train_time_s",
    "epochs_to_target",
    "batch_size",
    "precision",
    "notes",
)

ModelKey = tuple  # what makes a model the same as another cell's (Workload.model_key)


def _key(c: CellConfig, role: str = "teacher") -> ModelKey:
    """The ``role`` model of cell ``c``, as its family tells models apart (an image classifier by its input
    shape and layout, a language model by its config overrides)."""
    return workload_of(c).model_key(c, role)


def _overrides(c: CellConfig, role: str) -> str | None:
    """A model's config overrides as the row names them (sorted JSON), None without any: two LM cells of one
    registry name but other shapes are other models."""
    over = workload_of(c).model_overrides(c, role)
    return json.dumps(over, sort_keys=True) if over else None


def _init_seed(seed: int, role: str) -> int:
    """Teachers and students of one seed start from different draws (2s + 1 and 2s)."""
    return 2 * seed + (1 if role == "teacher" else 0)


def quality_jobs(configs: Iterable[CellConfig]) -> list[CellConfig]:
    """One distillation per distinct (teacher, student, method, LM overrides): the first planned cell that has it."""
    return _distinct(
        list(configs),
        lambda c: (c.pair.teacher, c.pair.student, c.method, _overrides(c, "teacher"), _overrides(c, "student")),
    )


@dataclass(frozen=True)
class Entry:
    """One row of the protocol: a model trained in one role for one seed."""

    seed: int
    role: str  # teacher, scratch or distilled
    config: CellConfig  # the planned cell it comes from

    @property
    def teacher_key(self) -> ModelKey:
        return _key(self.config)

    @property
    def student_key(self) -> ModelKey:
        return _key(self.config, "student")

    def row(self, cfg: QualityConfig) -> dict[str, Any]:
        """The row without results (status ok until told otherwise)."""
        c = self.config
        row = Row(dict.fromkeys(ROW_KEYS))
        row.update(
            measurement=Measurement.QUALITY,
            status=Status.OK,
            quality_role=self.role,
            teacher=c.pair.teacher,
            student=None if self.role == "teacher" else c.pair.student,
            teacher_overrides=_overrides(c, "teacher"),
            student_overrides=None if self.role == "teacher" else _overrides(c, "student"),
            method=c.method if self.role == "distilled" else None,
            seed=self.seed,
            quality_dataset=cfg.dataset,
            quality_epochs=cfg.epochs,
            quality_target=cfg.target,
            batch_size=cfg.batch_size,
            precision=c.precision,
        )
        step_only = [
            k
            for k, on in (("on_policy", c.on_policy), ("teacher.mode topk_cache", c.teacher.mode == "topk_cache"))
            if on
        ]
        if self.role == "distilled" and step_only:
            row["notes"] = (
                f"trained off-policy from the live teacher, as the protocol trains every student: the cell's "
                f"{' and '.join(step_only)} are step settings it does not apply"
            )
        if cfg.dataset in TEXT_DATASETS:
            from kdbench.quality.text import text_columns

            row.update(text_columns(cfg))
        return row


def quality_plan(cfg: QualityConfig, jobs: list[CellConfig]) -> list[Entry]:
    """Per seed: each distinct teacher (name, shape, precision, memory format), a scratch row per distinct
    (teacher, student) pair (agreement and time to target are measured against the pair's teacher), and
    each job's distilled student."""
    teachers = _distinct(jobs, lambda c: _key(c))
    pairs = _distinct(jobs, lambda c: (_key(c), _key(c, "student")))
    plan = []
    for seed in range(cfg.seeds):
        plan += [Entry(seed, "teacher", c) for c in teachers]
        plan += [Entry(seed, "scratch", c) for c in pairs]
        plan += [Entry(seed, "distilled", c) for c in jobs]
    return plan


def _distinct(jobs: list[CellConfig], key: Callable[[CellConfig], Any]) -> list[CellConfig]:
    """The first job of each distinct ``key``, in plan order."""
    first: dict[Any, CellConfig] = {}
    for c in jobs:
        first.setdefault(key(c), c)
    return list(first.values())


def planned_rows(cfg: QualityConfig, jobs: list[CellConfig]) -> list[dict[str, Any]]:
    """The rows :func:`run_quality` produces, without results."""
    return [entry.row(cfg) for entry in quality_plan(cfg, jobs)]


def _describe(result: Trained, agreement: float | None = None) -> str:
    text = f"top-1 {result.accuracy:.1%} (best {result.best_accuracy:.1%}), {result.train_time_s:.2f} s training"
    return text + (f", agreement {agreement:.1%}" if agreement is not None else "")


def _results(row: dict[str, Any], cfg: QualityConfig, result: Trained, reference: Trained | None) -> dict[str, Any]:
    """``row`` with the record of ``result``, measured against ``reference`` (the seed's teacher)."""
    row.update(accuracy=result.accuracy, best_accuracy=result.best_accuracy, train_time_s=result.train_time_s)
    if reference is not None:
        seconds, epoch = result.reach(cfg.target * reference.accuracy)
        row.update(time_to_target_s=seconds, epochs_to_target=epoch)
        if reference is not result:
            row["agreement"] = float((result.preds == reference.preds).float().mean())
    return row


class _Run:
    """The state of one quality run: data on the device, and the models trained so far per seed."""

    def __init__(self, cfg: QualityConfig, backend: Backend, allow_imports: bool):
        self.cfg, self.backend = cfg, backend
        self.cache = ModelCache(allow_imports, capacity=64)
        self.datasets: dict[tuple[int, ...], Dataset] = {}
        self.on_device: dict[tuple[tuple[int, ...], str], DeviceData] = {}
        self.trained: dict[tuple[int, str, ModelKey], Trained | str] = {}  # (seed, teacher|scratch, key): or error

    def data(self, c: CellConfig) -> DeviceData:
        shape = tuple(c.data.shape)
        if shape not in self.datasets:
            self.datasets[shape] = load_dataset(self.cfg, shape, seed=0)
        key = (shape, c.memory_format)
        if key not in self.on_device:
            d, dev, fmt = self.datasets[shape], self.backend.device, memory_format_of(c.memory_format)
            self.on_device[key] = DeviceData(
                d.x_train.to(dev).contiguous(memory_format=fmt),
                d.y_train.to(dev),
                d.x_test.to(dev).contiguous(memory_format=fmt),
                d.y_test,
                d.num_classes,
                fmt,
            )
        return self.on_device[key]

    def cell(self, c: CellConfig, seed: int) -> CellConfig:
        """The job's cell for quality: the data set's classes, no padding, a live teacher, the quality recipe."""
        return c.model_copy(
            update={
                "data": c.data.model_copy(update={"num_classes": self.data(c).num_classes}),
                "pad_to": 1,
                "teacher": TeacherConfig(mode="live"),
                "optimizer": self.cfg.optimizer_config(),
                "batch_size": self.cfg.batch_size,
                "world_size": 1,
                "seed": seed,
            }
        )

    def model(self, name: str, cell: CellConfig, role: str) -> nn.Module:
        model = self.cache.get(name, cell.data.num_classes, tuple(cell.data.shape), _init_seed(cell.seed, role))
        return place_model(model, self.backend.device, cell.memory_format, True)

    def ce_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, choice: Any) -> Callable:
        return ce_step(model, optimizer, choice, self.backend)

    def fit(self, step: Callable, model: nn.Module, optimizer: Any, data: DeviceData, seed: int, choice: Any):
        return fit(step, model, optimizer, data, self.cfg, self.backend, seed, choice)

    def fill(self, row: dict[str, Any], result: Trained | str, reference: Trained | str | None) -> dict[str, Any]:
        return _fill(row, self.cfg, result, reference)

    def describe(self, result: Trained, agreement: float | None = None) -> str:
        return _describe(result, agreement)

    def attempt(self, what: str, fn: Callable[[], Trained]) -> Trained | str:
        """``fn()``, logged; its one-line error instead when it raises (the run goes on)."""
        try:
            result = fn()
        except Exception as exc:
            if self.backend.device_type == "cuda":
                torch.cuda.empty_cache()
            logger.info("  %s: FAILED: %s", what, error_text(exc))
            return error_text(exc)
        return result

    def train_ce(self, entry: Entry, role: str) -> Trained | str:
        """The seed's teacher or scratch student, trained with cross-entropy once and remembered."""
        key = entry.teacher_key if role == "teacher" else entry.student_key
        if (entry.seed, role, key) not in self.trained:
            cell = self.cell(entry.config, entry.seed)
            name = key[0]

            def train() -> Trained:
                model = self.model(name, cell, "teacher" if role == "teacher" else "student")
                model.train()
                optimizer = make_optimizer(model.parameters(), cell.optimizer)
                choice = choose_autocast(self.backend, cell.precision)
                step = self.ce_step(model, optimizer, choice)
                with math_mode(choice.tf32):
                    out = self.fit(step, model, optimizer, self.data(cell), entry.seed, choice)
                if role == "teacher":
                    out.model = model
                logger.info("  quality seed %d: %s %s: %s", entry.seed, role, name, self.describe(out))
                return out

            self.trained[(entry.seed, role, key)] = self.attempt(f"quality seed {entry.seed}: {role} {name}", train)
        return self.trained[(entry.seed, role, key)]

    def distil(self, entry: Entry, teacher: Trained) -> Trained:
        cell = self.cell(entry.config, entry.seed)
        data = self.data(cell)
        cell = bank_sized(cell, len(data.x_train))
        student = self.model(cell.pair.student, cell, "student")
        teacher_copy = copy.deepcopy(teacher.model)
        distiller = Distiller(teacher_copy, student, cell, self.backend, data.x_train[:2], workload_of(cell))
        try:
            model, opt = distiller.student, distiller.optimizer

            def step(x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
                return distiller.train_step(x, y, indices=indices)

            with math_mode(distiller.student_ac.tf32):
                return self.fit(step, model, opt, data, entry.seed, distiller.student_ac)
        finally:
            distiller.close()

    def execute(self, entry: Entry) -> dict[str, Any]:
        """Train (or recall) what ``entry`` needs and return its row."""
        row = entry.row(self.cfg)
        c = entry.config
        skip = next((s for p in {c.precision, c.teacher_precision} if (s := choose_autocast(self.backend, p).skip)), "")
        if skip:  # a precision this backend cannot run (tf32 on the CPU)
            return row | {"status": Status.SKIPPED, "error": skip}
        if entry.role == "teacher":
            teacher = self.train_ce(entry, "teacher")
            return self.fill(row, teacher, teacher)
        teacher = self.trained.get((entry.seed, "teacher", entry.teacher_key))
        if entry.role == "scratch":
            return self.fill(row, self.train_ce(entry, "scratch"), teacher)
        c = entry.config
        what = f"quality seed {entry.seed}: distilled {c.method} {c.pair.teacher}->{c.pair.student}"
        if not isinstance(teacher, Trained):
            logger.info("  %s: FAILED: the teacher failed to train", what)
            return self.fill(row, f"the teacher failed to train: {teacher}"[:2000], None)
        result = self.attempt(what, lambda: self.distil(entry, teacher))
        self.fill(row, result, teacher)
        if isinstance(result, Trained):
            logger.info("  %s: %s", what, self.describe(result, row["agreement"]))
        return row


def _fill(row: dict[str, Any], cfg: QualityConfig, result: Trained | str, reference: Trained | str | None):
    """``row`` with ``result``'s record, or failed with its error."""
    if isinstance(result, str):
        row.update(status=Status.FAILED, error=result)
        return row
    return _results(row, cfg, result, reference if isinstance(reference, Trained) else None)


def run_quality(
    cfg: QualityConfig, jobs: list[CellConfig], backend: Backend, allow_imports: bool = False
) -> list[dict[str, Any]]:
    """Every row of :func:`quality_plan`: one per trained model and seed.

    Each distinct teacher trains once per seed and its trained weights serve every job
    with that teacher; each distinct student trains once from scratch; each job distils
    a fresh student.  A model that fails to build or train gives a failed row (and a
    failed teacher fails its distillations); the others still run.  Data-set errors
    (``KdbenchError``) are raised before anything trains.
    """
    if cfg.dataset in TEXT_DATASETS:  # language models on text (kdbench.quality.text): the same protocol
        from kdbench.quality.text import TextRun

        run: _Run = TextRun(cfg, backend, allow_imports)
    else:
        run = _Run(cfg, backend, allow_imports)
    for job in jobs:
        run.data(job)  # load (and check) every data set first
    devices = [backend.device] if backend.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the caller's random state is left as it was
        return [run.execute(entry) for entry in quality_plan(cfg, jobs)]


def bank_sized(cell: CellConfig, n_train: int) -> CellConfig:
    """A CRD cell's memory bank sized to the training set (one entry per sample, indexed by the samples'
    data-set indices), with at most n_train - 1 negatives per sample."""
    if "crd" not in method_parts(cell.method):
        return cell
    crd = cell.crd.model_copy(update={"n_data": n_train, "nce_k": min(cell.crd.nce_k, max(1, n_train - 1))})
    return cell.model_copy(update={"crd": crd})
