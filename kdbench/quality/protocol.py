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

This module plans the rows and runs them in order (:func:`execute`); how each model trains, and
what a run holds, is :class:`kdbench.quality.train.QualityRun`.  Language-model pairs on text
(``dataset: python-stdlib``) follow the same plan, seeds and recipe:
:class:`kdbench.quality.text.TextRun` is that run with the text data, the byte-vocabulary models,
next-byte cross-entropy and a record of held-out perplexity (time to quality: the perplexity at
most the teacher's / ``target``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdbench.config.plan import config_dict
from kdbench.config.quality import DISK_DATASETS, TEXT_DATASETS, QualityConfig
from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.names import Measurement, Status
from kdbench.core.schema import Row
from kdbench.core.worker_state import finished
from kdbench.data.datasets import image_shape
from kdbench.data.text import own_tokenizer
from kdbench.hw.backends import Backend, choose_autocast
from kdbench.quality.checkpoints import Checkpoints
from kdbench.quality.progress import Talk
from kdbench.quality.text import TextRun, check_text, text_columns
from kdbench.quality.train import ModelKey, QualityRun, Trained
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


def _key(c: CellConfig, role: str = "teacher") -> ModelKey:
    """The ``role`` model of cell ``c``, as its family tells models apart (an image classifier by its input
    shape and layout, a language model by its config overrides), and a student of its own tokenizer by it."""
    key = workload_of(c).model_key(c, role)
    spec = own_tokenizer(c) if role == "student" else None
    return key if spec is None else (*key, ("tokenizer", spec))


def _overrides(c: CellConfig, role: str) -> str | None:
    """A model's config overrides as the row names them (sorted JSON), None without any: two LM cells of one
    registry name but other shapes are other models."""
    over = workload_of(c).model_overrides(c, role)
    return json.dumps(over, sort_keys=True) if over else None


def quality_jobs(configs: Iterable[CellConfig]) -> list[CellConfig]:
    """One distillation per distinct (teacher, student, method, LM overrides, ULD's alignment): the first planned
    cell that has it."""
    return _distinct(
        list(configs),
        lambda c: (
            c.pair.teacher,
            c.pair.student,
            c.method,
            _overrides(c, "teacher"),
            _overrides(c, "student"),
            own_tokenizer(c),
            c.uld.alignment if c.method == "uld" else None,
            json.dumps(config_dict(c)["teacher"], sort_keys=True) if c.teacher.mode == "offline" else None,
        ),
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

    def describe(self) -> str:
        """Which model, for the progress lines."""
        c = self.config
        if self.role == "teacher":
            return f"seed {self.seed}: teacher {c.pair.teacher}"
        spec = own_tokenizer(c)
        student = c.pair.student if spec is None else f"{c.pair.student} ({spec})"
        if self.role == "scratch":
            return f"seed {self.seed}: scratch {student}"
        method = f"uld ({c.uld.alignment})" if c.method == "uld" and c.uld.alignment != "position" else c.method
        if c.teacher.mode == "offline":
            method = f"{method} (offline {offline_encoding(c)})"
        return f"seed {self.seed}: distilled {method} {c.pair.teacher}->{student}"

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
            row.update(text_columns(cfg, c, self.role))
        if self.role == "distilled" and c.teacher.mode == "offline":  # trained from a store in this encoding
            row["teacher_store_encoding"] = offline_encoding(c)
        return row


def offline_encoding(c: CellConfig) -> str:
    """An offline-teacher student's store encoding (:mod:`kdbench.quality.offline`: over the bytes)."""
    from kdbench.data.text import BYTES
    from kdbench.workloads.lm.offline import encoding_of

    return encoding_of(c, BYTES).label


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


def execute(run: QualityRun, entry: Entry) -> dict[str, Any]:
    """Train (or recall) with ``run`` what ``entry`` needs and return its row."""
    row = entry.row(run.cfg)
    run.talk.model(entry.describe())
    c = entry.config
    skip = next((s for p in {c.precision, c.teacher_precision} if (s := choose_autocast(run.backend, p).skip)), "")
    if skip:  # a precision this backend cannot run (tf32 on the CPU)
        return row | {"status": Status.SKIPPED, "error": skip}
    if entry.role == "teacher":
        teacher = run.train_ce(c, entry.seed, "teacher", entry.teacher_key)
        return _noted(run.fill(row, teacher, teacher), teacher)
    teacher = run.trained.get((entry.seed, "teacher", entry.teacher_key))
    if entry.role == "scratch":
        scratch = run.train_ce(c, entry.seed, "scratch", entry.student_key)
        return _noted(run.fill(row, scratch, teacher), scratch)
    what = f"quality seed {entry.seed}: {entry.describe().split(': ', 1)[1]}"
    if not isinstance(teacher, Trained):
        logger.info("  %s: FAILED: the teacher failed to train", what)
        return run.fill(row, f"the teacher failed to train: {teacher}"[:2000], None)
    result = run.attempt(what, lambda: run.distil(c, entry.seed, teacher))
    run.fill(row, result, teacher)
    if isinstance(result, Trained):
        logger.info("  %s: %s", what, run.describe(result, row["agreement"]))
    return _noted(row, result)


def _noted(row: dict[str, Any], result: Trained | str) -> dict[str, Any]:
    """``row`` with what its model's record says of where it came from (its checkpoint, or trained again)."""
    note = result.note if isinstance(result, Trained) else None
    if note:
        row["notes"] = "; ".join(n for n in (row["notes"], note) if n)
    return row


def run_quality(
    cfg: QualityConfig,
    jobs: list[CellConfig],
    backend: Backend,
    allow_imports: bool = False,
    checkpoints: Path | None = None,
) -> list[dict[str, Any]]:
    """Every row of :func:`quality_plan`: one per trained model and seed.

    Each distinct teacher trains once per seed and its trained weights serve every job
    with that teacher; each distinct student trains once from scratch; each job distils
    a fresh student.  A model that fails to build or train gives a failed row (and a
    failed teacher fails its distillations); the others still run.  Data-set errors
    (``KdbenchError``) are raised before anything trains.  With ``checkpoints`` (a folder) each
    trained model is kept there as it finishes, and one already kept there with the same identity is
    not trained again (:mod:`kdbench.quality.checkpoints`).  Progress is logged as it goes
    (:mod:`kdbench.quality.progress`).
    """
    plan = quality_plan(cfg, jobs)
    store = None if checkpoints is None else Checkpoints(Path(checkpoints))
    if cfg.dataset in TEXT_DATASETS:  # language models on text (kdbench.quality.text): the same protocol
        run: QualityRun = TextRun(cfg, backend, allow_imports, store)
    else:
        run = QualityRun(cfg, backend, allow_imports, store)
    run.talk = talk = Talk(len(plan))
    where = f"; each kept as it finishes in {checkpoints}" if checkpoints is not None else ""
    talk.job(f"{cfg.seeds} seed(s), {cfg.epochs} epochs each on {cfg.dataset}{where}")
    try:
        for job in jobs:
            run.data(job)  # load (and check) every data set first
        devices = [backend.device] if backend.device_type == "cuda" else []
        rows: list[dict[str, Any]] = []
        with torch.random.fork_rng(devices=devices):  # the caller's random state is left as it was
            for entry in plan:
                rows.append(execute(run, entry))
                finished(rows)  # a worker that dies later keeps them (kdbench.run.jobs.failure_rows)
        return rows
    finally:
        talk.account()


def check_quality(cfg: QualityConfig, configs: Iterable[CellConfig]) -> None:
    """The cheap checks, before anything runs: a text data set's LM cells (:func:`kdbench.quality.text.check_text`),
    or an image data set's image cells and folder (:func:`kdbench.data.datasets.check_images`)."""
    if cfg.dataset in TEXT_DATASETS:
        return check_text(cfg, configs)
    return check_images(cfg, configs)


def check_images(cfg: QualityConfig, configs: Iterable[CellConfig]) -> None:
    """The cheap checks of an image data set, before anything runs: image cells, and a data folder that exists."""
    for c in configs:
        if workload_of(c).quality_data != "images":
            raise KdbenchError(
                f"quality dataset {cfg.dataset} holds images and {c.pair.teacher} -> {c.pair.student} is a "
                "language-model pair (data.kind: tokens); use dataset: python-stdlib (text)"
            )
        image_shape(c.data.shape)
    if cfg.dataset in DISK_DATASETS and cfg.root and not Path(cfg.root).expanduser().exists():
        raise KdbenchError(
            f"quality.root: {cfg.root} does not exist; give the folder that holds the "
            f"{cfg.dataset} data (nothing is downloaded)"
        )
