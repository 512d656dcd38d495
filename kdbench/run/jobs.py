"""Jobs: what the engine hands a worker, and what a worker runs them with.

A job is the unit of isolation, time-out, storage and resume: one cell of the plan
(:class:`CellJob`), or the suite's quality block (:class:`QualityJob`).  Each says
which rows it will produce (``planned``, so a job that dies is stored as exactly
those rows, marked), which columns identify it on every row (``columns``), and how
it runs inside a worker (``run``, with the worker's :class:`WorkerContext`).  Jobs are
small frozen dataclasses: they cross process boundaries by pickle.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kdbench.config.plan import Cell, config_dict, method_params
from kdbench.config.quality import TEXT_DATASETS, QualityConfig
from kdbench.config.schema import CellConfig
from kdbench.core.names import Status, planned_row
from kdbench.core.schema import Row
from kdbench.core.worker_state import WorkerState, install
from kdbench.hw.backends import Backend, dist_backend_for
from kdbench.measure.memory import freeze_imports
from kdbench.measure.rows import failure_rows as planned_failures
from kdbench.measure.step import MeasureOptions
from kdbench.models import ModelCache
from kdbench.workloads import planned_measurements, workload_of


class WorkerContext:
    """What a job runs with inside its worker: the device, the measuring options, a model cache, and the state the
    worker keeps between measurements (:class:`kdbench.core.worker_state.WorkerState`, installed while it lives)."""

    def __init__(self, backend: Backend, options: MeasureOptions, allow_imports: bool):
        self.backend = backend
        self.options = options
        self.cache = ModelCache(allow_imports=allow_imports)
        self.state = WorkerState()
        install(self.state)
        freeze_imports()  # each measurement's gc.collect() then scans only what measurements made


@dataclass(frozen=True)
class CellJob:
    cell: Cell
    repeat: int = 1  # which of the suite's `repeat` measurements of the cell (1..N)
    repeats: int = 1  # N
    reuse_teacher: tuple[int, ...] = ()  # batch sizes whose teacher inference an earlier cell measured

    def teacher_keys(self) -> dict[int, tuple]:
        """Per inference batch size, what makes this cell's teacher inference the same measurement as
        another's: the teacher model, its input and placement, the device levers, how it is timed (the
        timing settings and its share of the cell's time budget), the world size, the repeat."""
        c = self.cell.config
        if not c.inference.teacher:
            return {}
        t = c.timing
        same = (
            c.pair.teacher,
            c.precision,
            c.teacher.weights,
            tuple(c.data.shape),
            # token inputs (encoder pairs serve teacher_inference too): their length and the teacher's overrides
            c.data.kind,
            c.data.seq_len if c.data.is_tokens else None,
            repr(sorted(c.overrides.teacher.items())),
            c.data.num_classes,
            c.pad_to,
            c.memory_format,
            c.alignment,
            c.seed,
            c.conv_autotune,
            c.tunableop,
            c.world_size,
            (t.warmup, t.min_iters, t.min_time_s, t.max_iters, t.target_rel_ci, t.max_time_s, t.cell_budget_s),
            len(planned_measurements(c)),  # the default budget is shared by the cell's measurements
            self.repeat,
        )
        return {bs: (*same, bs) for bs in c.inference.batch_sizes}

    @property
    def job_id(self) -> str:
        """The cell's id; later repeats add ``-r<k>``, so raising ``repeat`` and resuming runs only the new ones."""
        from kdbench.store.results import job_id

        return job_id(self.cell.cell_id, self.repeat)

    @property
    def cell_id(self) -> str:
        return self.cell.cell_id

    @property
    def progress_label(self) -> str:
        return self.label if self.repeats == 1 else f"{self.label} (repeat {self.repeat}/{self.repeats})"

    @property
    def label(self) -> str:
        return self.cell.label

    @property
    def world_size(self) -> int:
        return self.cell.config.world_size

    @property
    def precision(self) -> str:
        return self.cell.config.precision

    @property
    def teacher_precision(self) -> str:
        return self.cell.config.teacher_precision

    def planned(self) -> list[Row]:
        return [Row(planned_row(m, bs)) for m, bs in self.planned_order()]

    def planned_order(self) -> list[tuple[str, int]]:
        return planned_measurements(self.cell.config)

    def columns(self, backend_name: str) -> Row:
        return config_columns(self.cell.config, backend_name) | {"repeat": self.repeat}

    def run(self, ctx: WorkerContext) -> list[Row]:
        from kdbench.run.cell import measure_cell

        return measure_cell(self.cell, ctx.backend, ctx.cache, ctx.options, skip_teacher=self.reuse_teacher) or []


@dataclass(frozen=True)
class QualityJob:
    """The suite's quality block: every distillation of the plan trained on real data, as one job."""

    quality: QualityConfig
    configs: tuple[CellConfig, ...]  # one per distinct (teacher, student, method), in plan order
    allow_imports: bool = False

    @classmethod
    def of(cls, quality: QualityConfig, cells: list[Cell], allow_imports: bool) -> QualityJob:
        from kdbench.quality.protocol import quality_jobs

        return cls(quality, tuple(quality_jobs(c.config for c in cells)), allow_imports)

    @property
    def job_id(self) -> str:
        """Hashes the quality settings and the jobs' cells, so a rerun of the same suite finds it again."""
        return self._hashed(self.quality)

    @property
    def models_id(self) -> str:
        """The job id without what is measured after the models train (``quality.speculative``): the folder its
        models are kept in, so that the same models, measured otherwise, are not trained again (and a run stored
        before ``speculative`` existed lends its kept models to the same block with it)."""
        return self._hashed(self.quality.model_copy(update={"speculative": None}))

    def _hashed(self, quality: QualityConfig) -> str:
        key = json.dumps(
            {"quality": quality_dict(quality), "jobs": [config_dict(c) for c in self.configs]},
            sort_keys=True,
        )
        return "quality-" + hashlib.sha256(key.encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        q = self.quality
        return f"quality ({q.dataset}, {q.seeds} seed{'s' if q.seeds > 1 else ''})"

    world_size = 1
    precision = teacher_precision = None
    repeat = 1  # the quality block runs once, whatever the suite's `repeat`

    @property
    def cell_id(self) -> str:
        return self.job_id

    @property
    def progress_label(self) -> str:
        return self.label

    def describe(self) -> str:
        q = self.quality
        return (
            f"quality on {q.dataset}: {q.seeds} seed(s) x (teachers, scratch students and {len(self.configs)} "
            f"distillation(s)), {q.epochs} epochs each, "
            + (
                f"target a perplexity per byte <= the teacher's / {q.target:g}"
                if q.dataset in TEXT_DATASETS
                else f"target {q.target:g} x the teacher's accuracy"
            )
        )

    def planned(self) -> list[Row]:
        from kdbench.quality.protocol import planned_rows

        return planned_rows(self.quality, list(self.configs))

    def columns(self, backend_name: str) -> Row:
        return {}  # each quality row names its own teacher, student, method, seed and precision

    def checkpoints(self, run_dir: str | None) -> Path | None:
        """Where the job keeps each model it trained, in the run folder (:mod:`kdbench.quality.checkpoints`)."""
        from kdbench.quality.checkpoints import CHECKPOINTS_DIR

        return None if run_dir is None else Path(run_dir) / CHECKPOINTS_DIR / self.models_id

    def run(self, ctx: WorkerContext) -> list[Row]:
        from kdbench.quality.protocol import run_quality

        # its wall time is counted to "quality" as it trains (kdbench.quality.progress), not only at its end
        return run_quality(
            self.quality,
            list(self.configs),
            ctx.backend,
            allow_imports=self.allow_imports,
            checkpoints=self.checkpoints(ctx.options.run_dir),
        )


Job = CellJob | QualityJob

# text-only keys: unset, out of the job's identity
QUALITY_IDENTITY_DEFAULTS = {"seq_len": None, "max_bytes": None, "speculative": None}


def quality_dict(quality: QualityConfig) -> dict:
    """The quality block as its job id hashes it: keys added since at their default left out, so the quality jobs
    of earlier runs keep their ids (and ``--resume`` finds them)."""
    out = quality.model_dump(mode="json")
    for key, default in QUALITY_IDENTITY_DEFAULTS.items():
        if out.get(key, default) == default:
            out.pop(key, None)
    return out


def failure_rows(job: Job, status: Status, error: str, finished: list[Row] | tuple = ()) -> list[Row]:
    """Every row ``job`` would have produced, marked with ``status`` and ``error``; but the first ``len(finished)``,
    which the job had finished before it failed (the quality job's models trained by then), as they are."""
    rows = planned_failures(job.planned(), status, error)
    return [*finished, *rows[len(finished) :]]


# The config columns a family fills (:meth:`kdbench.workloads.base.Workload.config_columns`); empty on the rows of
# the others (an LM method's temperature and alpha are in method_params).
FAMILY_CONFIG_COLUMNS = (
    "data_shape",
    "num_classes",
    "seq_len",
    "loss_impl",
    "chunk_size",
    "generation",
    "kd_temperature",
    "kd_alpha",
)


def host_models_bytes(config: CellConfig, backend_name: str) -> int | None:
    """What the cell's models take of rank 0's host, as the plan counts it (None: not counted before the run)."""
    device_type = "cpu" if backend_name == "cpu" else "cuda"
    return workload_of(config).host_footprint(config, device_type).rank_bytes(True)


def config_columns(config: CellConfig, backend_name: str) -> Row:
    """The result columns that come from a cell's config."""
    parallel = config.world_size > 1
    fsdp = parallel and config.parallel == "fsdp"
    resolved = config_dict(config)
    family = dict.fromkeys(FAMILY_CONFIG_COLUMNS) | workload_of(config).config_columns(config)
    return Row(
        {
            "teacher": config.pair.teacher,
            "student": config.pair.student,
            "method": config.method,
            "precision": config.precision,
            "teacher_precision": config.teacher_precision,
            "teacher_weights": config.teacher.weights,
            "memory_format": config.memory_format,
            "alignment": config.alignment,
            "pad_to": config.pad_to,
            "world_size": config.world_size,
            "dist_backend": dist_backend_for(backend_name) if parallel else None,
            "parallel": config.parallel if parallel else None,
            "fsdp_reshard_after_forward": config.fsdp.reshard_after_forward if fsdp else None,
            "fsdp_cpu_offload": config.fsdp.cpu_offload if fsdp else None,
            "ddp_bucket_cap_mb": config.ddp.bucket_cap_mb if parallel and not fsdp else None,
            "ddp_gradient_as_bucket_view": config.ddp.gradient_as_bucket_view if parallel and not fsdp else None,
            "ddp_static_graph": config.ddp.static_graph if parallel and not fsdp else None,
            "data_kind": config.data.kind,
            **family,
            "host_models_bytes": host_models_bytes(config, backend_name),
            "on_policy_lambda": config.on_policy.lmbda if config.on_policy else None,
            "on_policy_new_tokens": config.on_policy.new_tokens if config.on_policy else None,
            "teacher_mode": config.teacher.mode,
            "method_params": json.dumps(method_params(config), sort_keys=True),
            "optimizer": config.optimizer.name,
            "optimizer_impl": config.optimizer.impl,
            "compile": config.compile,
            "compile_teacher": config.compile_teacher,
            "graphs": config.graphs,
            "conv_autotune": config.conv_autotune,
            "tunableop": config.tunableop,
            "lr": config.optimizer.lr,
            "seed": config.seed,
            "warmup": config.timing.warmup,
            "min_iters": config.timing.min_iters,
            "min_time_s": config.timing.min_time_s,
            "config_json": json.dumps(resolved, sort_keys=True),
        }
    )
