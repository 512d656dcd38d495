"""Parquet storage of measurements: the schema, per-cell atomic appends, reading.

One parquet file per run.  ``ResultWriter.append`` rewrites the whole file under a
temporary name and renames it over the old one (``os.replace`` is atomic on POSIX),
so a reader, or a run killed at any moment, sees either the previous complete file
or the new complete file — never half of one.

``SCHEMA`` is the single source of the column list: the writer casts every row to
it, the README documents it (a test checks that the two agree), and the report reads
it back.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kdbench.errors import KdbenchError

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    unit: str
    doc: str


_S, _I, _F, _B = pa.string(), pa.int64(), pa.float64(), pa.bool_()

COLUMNS: tuple[Column, ...] = (
    # --- identity ---------------------------------------------------------------
    Column("schema_version", pa.int32(), "", "version of this column layout (1)"),
    Column("run_id", _S, "", "unique id of the run; also the parquet file's name"),
    Column("suite", _S, "", "the suite's `name`"),
    Column("suite_file", _S, "", "path of the suite YAML as given to `run`"),
    Column("cell_id", _S, "", "stable hash of the resolved cell config (same cell, same id, in any rerun)"),
    Column("cell_label", _S, "", "short human label of the cell"),
    Column("measurement", _S, "", "`distill_step`, `student_inference`, `teacher_inference` or `quality`"),
    Column("status", _S, "", "`ok`, `failed`, `oom`, `timeout` or `skipped`"),
    Column("error", _S, "", "why the measurement failed or was skipped (null when ok)"),
    Column("notes", _S, "", "caveats of an ok row, e.g. why autocast was not applied at the asked precision"),
    Column("timestamp", pa.timestamp("us", tz="UTC"), "UTC", "when the measurement finished"),
    # --- config -----------------------------------------------------------------
    Column("teacher", _S, "", "teacher model name"),
    Column("student", _S, "", "student model name"),
    Column("method", _S, "", "distillation method (`kd`, ...)"),
    Column("precision", _S, "", "student precision: `fp32`, `fp16` or `bf16`"),
    Column("teacher_precision", _S, "", "teacher forward precision in the distillation step"),
    Column("batch_size", _I, "samples", "batch size of this measurement (per rank)"),
    Column("backend", _S, "", "backend the cell ran on: `cpu`, `cuda` or `rocm`"),
    Column("device", _S, "", "torch device, e.g. `cpu` or `cuda:0`"),
    Column("memory_format", _S, "", "`contiguous` or `channels_last`"),
    Column("alignment", _I, "bytes", "requested byte alignment of the step's input buffers"),
    Column("pad_to", _I, "", "classifier width padded to a multiple of this (1: no padding)"),
    Column("padded_classes", _I, "", "classifier width after padding (the pad is sliced out of loss and accuracy)"),
    Column("world_size", _I, "ranks", "data-parallel ranks"),
    Column(
        "dist_backend",
        _S,
        "",
        "torch.distributed backend of world_size > 1 cells: `gloo` (CPU) or `nccl` (CUDA, RCCL on ROCm)",
    ),
    Column("ddp_bucket_cap_mb", _F, "MiB", "DDP gradient bucket size"),
    Column("ddp_gradient_as_bucket_view", _B, "", "DDP gradient_as_bucket_view"),
    Column("ddp_static_graph", _B, "", "DDP static_graph"),
    Column("data_kind", _S, "", "`synthetic`"),
    Column("data_shape", _S, "", "shape of one input sample, e.g. `3x32x32`"),
    Column("num_classes", _I, "", "classifier width"),
    Column("kd_temperature", _F, "", "KD softmax temperature T"),
    Column("kd_alpha", _F, "", "KD weight α of the soft-target term"),
    Column("method_params", _S, "", "JSON of the hyper-parameters of the cell's method terms (and `weights`)"),
    Column("teacher_mode", _S, "", "`live` (teacher forward every step) or `cached` (its outputs computed once)"),
    Column("optimizer", _S, "", "student optimizer name"),
    Column("lr", _F, "", "student learning rate"),
    Column("seed", _I, "", "random seed of weights and data"),
    Column("warmup", _I, "iterations", "untimed iterations after the first (cold) one"),
    Column("min_iters", _I, "iterations", "minimum timed iterations"),
    Column("min_time_s", _F, "s", "minimum timed duration"),
    Column("autocast", _B, "", "whether torch.amp.autocast was applied to the measured forward"),
    Column("teacher_autocast", _B, "", "whether autocast was applied to the teacher forward of the step"),
    Column("grad_scaler", _B, "", "whether a GradScaler scaled the loss (fp16 steps)"),
    Column("config_json", _S, "", "the whole resolved cell config as JSON"),
    # --- statistics -------------------------------------------------------------
    Column("n", _I, "samples", "number of timed iterations"),
    Column("median_ms", _F, "ms", "median iteration time"),
    Column("mean_ms", _F, "ms", "mean iteration time"),
    Column("std_ms", _F, "ms", "standard deviation (ddof=1)"),
    Column("iqr_ms", _F, "ms", "interquartile range p75 − p25"),
    Column("p05_ms", _F, "ms", "5th percentile"),
    Column("p95_ms", _F, "ms", "95th percentile"),
    Column("min_ms", _F, "ms", "fastest iteration"),
    Column("max_ms", _F, "ms", "slowest iteration"),
    Column("first_ms", _F, "ms", "the first (cold) iteration, not among the samples"),
    Column("samples_ms", pa.list_(_F), "ms", "every timed iteration, in order"),
    Column("rel_iqr", _F, "ratio", "iqr_ms / median_ms"),
    Column("noisy", _B, "", "rel_iqr > 0.10: treat the median with care"),
    Column("timer", _S, "", "`perf_counter_ns` (host clock) or `device_event` (CUDA/HIP events)"),
    # --- derived ----------------------------------------------------------------
    Column(
        "throughput",
        _F,
        "samples/s",
        "world_size × batch_size / median time (for world_size > 1, each iteration's slowest rank)",
    ),
    Column(
        "scaling_efficiency",
        _F,
        "ratio",
        "throughput / (world_size × throughput of the same cell at world_size 1), when that cell is in the run",
    ),
    Column(
        "speedup_vs_teacher", _F, "×", "teacher median / student median at this batch size (student_inference rows)"
    ),
    Column("final_loss", _F, "", "distillation loss of the last timed step (distill_step rows)"),
    Column("nonfinite_steps", _I, "steps", "steps whose loss was inf or NaN (all calls, warm-up included)"),
    Column("scaler_skips", _I, "steps", "optimizer updates the fp16 GradScaler skipped for inf/NaN gradients"),
    Column("phase_teacher_forward_ms", _F, "ms", "median teacher forward of the step (≈0 with a cached teacher)"),
    Column("phase_student_forward_ms", _F, "ms", "median student forward (with its adapters)"),
    Column("phase_loss_ms", _F, "ms", "median loss computation"),
    Column("phase_backward_ms", _F, "ms", "median zero_grad + backward"),
    Column("phase_optimizer_ms", _F, "ms", "median optimizer step (with GradScaler step and update)"),
    Column("phase_remainder_ms", _F, "ms", "median of step time − sum of its phases (Python overhead between stamps)"),
    Column("teacher_cache_ms", _F, "ms", "one-off time to compute the cached teacher outputs (teacher.mode cached)"),
    Column("teacher_features", _S, "", "teacher module paths whose outputs feature methods compare"),
    Column("student_features", _S, "", "student module paths paired with teacher_features"),
    Column("student_params", _I, "parameters", "student model parameter count (what serves inference)"),
    Column(
        "adapter_params",
        _I,
        "parameters",
        "parameters of the feature adapters (e.g. FitNet's regressor), trained with the student",
    ),
    Column("trainable_params", _I, "parameters", "student + adapter parameters: what the distillation step trains"),
    Column("teacher_params", _I, "parameters", "teacher parameter count"),
    Column(
        "time_to_steady_ms",
        _F,
        "ms",
        "from the cold call's start to the end of the first call within 10 % of the median (first_ms is the cold call alone)",
    ),
    Column("steady_after_iters", _I, "iterations", "calls (cold one included) until the first steady one"),
    Column(
        "flops", _F, "FLOP", "FLOPs of one iteration on one device (torch.utils.flop_counter: matmuls and convolutions)"
    ),
    Column("teacher_forward_flops", _F, "FLOP", "the teacher forward's share of `flops` (distill_step, live teacher)"),
    Column("student_flops", _F, "FLOP", "student forward + backward (+ adapters) share of `flops` (distill_step)"),
    Column("achieved_tflops", _F, "TFLOP/s", "flops / median time, per device"),
    Column("datasheet_device", _S, "", "the accelerator of the peak table this device matched"),
    Column(
        "datasheet_peak_tflops",
        _F,
        "TFLOP/s",
        "vendor dense peak at the cell's precision (kdbench.measure.flops.PEAKS)",
    ),
    Column("mfu", _F, "ratio", "achieved_tflops / datasheet_peak_tflops"),
    Column(
        "ceiling_tflops",
        _F,
        "TFLOP/s",
        "this device's measured matmul rate at the cell's precision (newest `kdbench probe`)",
    ),
    Column("ceiling_utilization", _F, "ratio", "achieved_tflops / ceiling_tflops"),
    Column("ceiling_probe_id", _S, "", "the probe the ceiling comes from"),
    Column(
        "memory_kind",
        _S,
        "",
        "`device` (allocator peak, reset before the measurement), `rss_hwm` (kernel high-water mark of the worker process, reset before) or `rss` (sampled)",
    ),
    Column(
        "peak_memory_bytes",
        _I,
        "bytes",
        "peak allocated device memory, or the worker's peak resident memory on the CPU",
    ),
    Column("peak_reserved_bytes", _I, "bytes", "peak memory reserved by the caching allocator (GPUs)"),
    Column("memory_growth_bytes", _I, "bytes", "memory at the end of the measurement minus at its start"),
    Column(
        "optimizer_state_bytes",
        _I,
        "bytes",
        "bytes of the optimizer's state tensors after the measurement (distill_step)",
    ),
    Column("telemetry", _S, "", "`pynvml` or `amdsmi` when GPU telemetry was read; else `unavailable: why`"),
    Column("power_w_mean", _F, "W", "mean board power over the timed iterations"),
    Column("power_w_max", _F, "W", "highest power sample"),
    Column("clock_mhz_mean", _F, "MHz", "mean graphics clock"),
    Column("temperature_c_max", _F, "°C", "highest GPU temperature sample"),
    Column("gpu_util_pct_mean", _F, "%", "mean GPU utilisation as the driver reports it"),
    Column("energy_per_step_j", _F, "J", "energy of the timed iterations / their number (power integrated over time)"),
    Column("samples_per_joule", _F, "samples/J", "samples processed per joule"),
    Column("trace_file", _S, "", "torch.profiler Chrome trace of the cell's step (`profile: true` or --profile)"),
    Column("top_ops", _S, "", "JSON: the traced step's top operators by self time (ms per step)"),
    Column("quality_role", _S, "", "quality rows: `teacher`, `scratch` (student trained alone) or `distilled`"),
    Column(
        "quality_dataset", _S, "", "quality rows: the real data set (`digits`, `imagefolder`, `cifar10`, `cifar100`)"
    ),
    Column("quality_epochs", _I, "epochs", "quality rows: training epochs"),
    Column("quality_target", _F, "ratio", "quality rows: the target, as a fraction of the teacher's accuracy"),
    Column("accuracy", _F, "ratio", "quality rows: top-1 test accuracy after the last epoch"),
    Column("best_accuracy", _F, "ratio", "quality rows: best top-1 test accuracy over the epochs"),
    Column(
        "agreement", _F, "ratio", "quality rows: share of test samples where student and teacher predict the same class"
    ),
    Column(
        "time_to_target_s",
        _F,
        "s",
        "quality rows: training wall time until accuracy ≥ target × the teacher's (null: not reached)",
    ),
    Column("epochs_to_target", _I, "epochs", "quality rows: epochs until the target was reached"),
    Column("train_time_s", _F, "s", "quality rows: total training wall time (evaluation excluded)"),
    Column("data_ptr_mod64", _I, "bytes", "input batch's realised data_ptr() % 64 (labels are placed alike)"),
    Column("memory_format_verified", _B, "", "the input and every 4-D weight are contiguous in `memory_format`"),
    # --- environment ------------------------------------------------------------
    Column("device_name", _S, "", "GPU name, or the CPU model for cpu cells"),
    Column("device_arch", _S, "", "GPU architecture (`gfx942`, `sm_90`, ...); CPU machine type for cpu"),
    Column("device_count", _I, "", "visible GPUs (0 on a CPU-only machine)"),
    Column("device_memory_bytes", _I, "bytes", "total memory of the device (host RAM for cpu)"),
    Column("driver_version", _S, "", "GPU driver version where readable"),
    Column("torch_version", _S, "", "torch.__version__"),
    Column("torchvision_version", _S, "", "torchvision.__version__"),
    Column("cuda_version", _S, "", "torch.version.cuda (null on ROCm and CPU builds)"),
    Column("hip_version", _S, "", "torch.version.hip (null on CUDA and CPU builds)"),
    Column("cudnn_version", _S, "", "torch.backends.cudnn.version(): cuDNN on CUDA, MIOpen on ROCm"),
    Column("cpu_model", _S, "", "CPU model name"),
    Column("cpu_threads", _I, "threads", "torch.get_num_threads() during the run (set explicitly)"),
    Column("cpu_count", _I, "", "logical CPUs of the host"),
    Column("hostname", _S, "", "host name"),
    Column("os", _S, "", "platform.platform()"),
    Column("python_version", _S, "", "Python version"),
    Column("kdbench_version", _S, "", "kdbench version"),
    Column("git_commit", _S, "", "kdbench git commit, when run from a checkout"),
    Column("cudnn_benchmark", _B, "", "torch.backends.cudnn.benchmark"),
    Column("blas_library", _S, "", "torch.backends.cuda.preferred_blas_library() on GPUs"),
    Column("cpu_capability", _S, "", "the CPU kernels torch dispatches to (`AVX2`, `AVX512`, ...)"),
    Column(
        "float32_matmul_precision", _S, "", "torch.get_float32_matmul_precision() (`highest` keeps fp32 GEMMs exact)"
    ),
    Column("tf32_matmul", _B, "", "torch.backends.cuda.matmul.allow_tf32"),
    Column("tf32_cudnn", _B, "", "torch.backends.cudnn.allow_tf32"),
    Column(
        "miopen_cache_warm",
        _B,
        "",
        "ROCm: MIOpen's find-db or kernel cache held entries when the run started (null elsewhere)",
    ),
    Column(
        "tunableop_cache_warm",
        _B,
        "",
        "TunableOp enabled and its results file present when the run started (null when disabled)",
    ),
    Column("env_knobs", _S, "", "JSON of speed-changing environment variables (MIOPEN_*, PYTORCH_TUNABLEOP_*, ...)"),
)

SCHEMA = pa.schema([pa.field(c.name, c.type) for c in COLUMNS]).with_metadata(
    {"kdbench_schema_version": str(SCHEMA_VERSION)}
)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows (dicts) to a table in SCHEMA; unknown keys are a bug, missing ones null."""
    for row in rows:
        extra = set(row) - set(COLUMN_NAMES)
        if extra:
            raise ValueError(f"row has columns not in the schema: {sorted(extra)}")
    data = {c.name: [row.get(c.name) for row in rows] for c in COLUMNS}
    return pa.Table.from_pydict(data, schema=SCHEMA)


class ResultWriter:
    """Appends rows to one parquet file; every append is an atomic replace."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rows: list[dict[str, Any]] = []
        if self.path.exists():
            self._rows = read_table(self.path).to_pylist()

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self._rows)

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        rows = list(rows)
        self._write(self._rows + rows)
        self._rows.extend(rows)

    def update(self, fill: Callable[[list[dict[str, Any]]], bool]) -> None:
        """Let `fill` change stored rows in place (derived columns); rewrite the file if it did."""
        rows = [dict(r) for r in self._rows]
        if fill(rows):
            self._write(rows)
            self._rows = rows

    def _write(self, rows: list[dict[str, Any]]) -> None:
        table = rows_to_table(rows)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        try:
            pq.write_table(table, tmp)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    """Read one result file through a single open file descriptor.

    A writer replaces the file by renaming a new one over it; reading by path can
    open it more than once (footer, then pages) and mix the old file with the new.
    One descriptor pins one inode: always a complete file.
    """
    with open(path, "rb") as fh:
        return pq.read_table(pa.BufferReader(fh.read()), columns=columns)


PROBES_DIR = "probes"  # `kdbench probe` files, under a results folder; not results themselves


def result_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand parquet files and folders (searched recursively, skipping probes/) into a sorted file list."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(
                sorted(
                    q
                    for q in p.rglob("*.parquet")
                    if not q.name.startswith(".") and PROBES_DIR not in q.relative_to(p).parts[:-1]
                )
            )
        elif p.is_file():
            files.append(p)
        else:
            raise KdbenchError(f"{p}: no such file or folder; give parquet files or folders that hold them")
    return files


def read_results(paths: Iterable[str | Path]):
    """Read result files (or folders of them) into one pandas DataFrame."""
    import pandas as pd

    files = result_files(paths)
    if not files:
        raise KdbenchError(f"no .parquet result files in {', '.join(map(str, paths))}; run `kdbench run SUITE` first")
    frames = []
    for f in files:
        try:
            frames.append(read_table(f).to_pandas())
        except Exception as exc:  # not a kdbench file, or a foreign/corrupt one
            raise KdbenchError(f"{f}: not a readable parquet file ({exc}); remove it or pass other files") from None
    return pd.concat(frames, ignore_index=True)


def schema_markdown() -> str:
    """The results schema as the Markdown table the README carries (a test keeps them equal)."""
    lines = ["| column | type | unit | meaning |", "|---|---|---|---|"]
    for c in COLUMNS:
        doc = c.doc.replace("|", "\\|")
        lines.append(f"| `{c.name}` | {c.type} | {c.unit} | {doc} |")
    return "\n".join(lines)
