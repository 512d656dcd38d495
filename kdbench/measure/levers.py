"""The levers a cell may pull beyond eager PyTorch, on the step side, and what each costs once.

* ``compile`` / ``compile_teacher``: ``torch.compile`` of the student's forward and backward
  (and of the teacher's forward) in the distillation step (:class:`kdbench.distill.step.Distiller`);
  the one-off cost is the compile time: the cold call and the warm-up calls (which may
  recompile) minus as many steady calls.  Graph breaks and compiled graphs come from
  ``torch._dynamo``'s counters, and frames compiled inside the timed window are counted
  as recompiles (a timed loop that recompiles measures the compiler).
* ``generation.compile`` of an on-policy LM cell: its generation phase's decode steps compiled
  (:mod:`kdbench.models.generation`), counted in the step's one-off cost as the compile above; a
  decode row counts its own (``one_off_kind`` ``decode compile``).
* ``optimizer.impl``: ``default``, ``foreach`` or ``fused`` (:func:`kdbench.distill.step.make_optimizer`).
* ``conv_autotune``: ``torch.backends.cudnn.benchmark`` around the cell's measurements: cuDNN's
  algorithm search on NVIDIA, MIOpen's on ROCm (its find mode and databases come from the
  ``MIOPEN_*`` environment, recorded in ``env_knobs``); the search happens in the first calls.
* ``tunableop``: PyTorch's TunableOp GEMM tuning (``torch.cuda.tunable``) on ROCm and CUDA (GEMMs
  only), its results file kept beside the results, one per device kind; the tuning happens in the
  first calls.  It is switched off after the cell whatever fails; tunings it starts from (a file
  left by an earlier run, or an earlier cell of the worker) are said in the rows' notes.

One-off costs are host time between synchronizations (:meth:`RawTiming.first_calls_ms`): what a
user waits for, whatever the device's events would make of a host-side compile.
* ``graphs`` and ``inference.runtime``: how the student is served (:mod:`kdbench.measure.runtimes`).

GPU-only levers on the CPU make the cell ``skipped`` with a reason (:func:`skip_reason`).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdbench.config.schema import CellConfig
from kdbench.core.worker_state import current
from kdbench.hw.backends import Backend
from kdbench.measure.timing import RawTiming

GPU_ONLY = {
    "graphs": "graphs: CUDA/HIP graphs capture GPU work: there is no graph to replay on the CPU",
    "conv_autotune": "conv_autotune sets cudnn.benchmark, the cuDNN/MIOpen algorithm search: GPUs only",
    "tunableop": "TunableOp tunes GEMMs on ROCm and CUDA: GPUs only",
}


def skip_reason(config: CellConfig, backend: Backend) -> str | None:
    """Why the cell cannot run on ``backend`` with its levers (None: it can)."""
    if backend.device_type != "cuda":
        pulled = [name for name in GPU_ONLY if getattr(config, name)]
        if pulled:
            return "; ".join(GPU_ONLY[name] for name in pulled) + " (run it with --device cuda or rocm)"
    if config.compile != "off" and config.world_size > 1:
        return "compile with world_size > 1: kdbench compiles single-device cells only"
    return None


def device_kind(backend: Backend) -> str:
    """What a device is, for files kept per device kind: the GPU's name (``torch.cuda.get_device_name``),
    else the backend's name (a simulated GPU in tests has no name)."""
    if backend.device.type == "cuda":
        return torch.cuda.get_device_name(backend.device)
    return backend.name


def tunableop_file(results_dir: str | None, device_name: str) -> Path | None:
    """Where a run keeps TunableOp's results: beside the results, one file per device kind
    (``device_name``: :func:`device_kind`, e.g. "NVIDIA H200" -> ``_tunableop-nvidia-h200.csv``)."""
    if results_dir is None:
        return None
    slug = "".join(ch if ch.isalnum() else "-" for ch in device_name).strip("-").lower() or "gpu"
    return Path(results_dir) / f"_tunableop-{slug}.csv"  # "_": parquet readers skip it in a run folder


TUNABLEOP_SCOPE = (
    "TunableOp tunes GEMMs only (matmuls and Linear layers: on a CNN, its classifier); convolutions keep "
    "their usual kernels"
)


@contextlib.contextmanager
def device_levers(config: CellConfig, backend: Backend, tunable_path: Path | None = None) -> Iterator[dict]:
    """The cell's device-wide levers set for its measurements and restored after them, whatever fails
    inside; yields the columns that record them (filled in when the block ends; ``notes``: what they
    imply for the rows, for the caller to add to each row's notes)."""
    row: dict[str, Any] = {}
    if backend.device_type != "cuda":
        yield row
        return
    cudnn = torch.backends.cudnn
    saved = cudnn.benchmark
    cudnn.benchmark = config.conv_autotune  # set, not inherited: the default differs by build
    try:
        if config.tunableop:
            with _tunableop(tunable_path, row):
                yield row
        else:
            yield row
    finally:
        cudnn.benchmark = saved


@contextlib.contextmanager
def _tunableop(path: Path | None, row: dict[str, Any]) -> Iterator[None]:
    """TunableOp on, tuning, with its results file at ``path``, inside; off after it whatever fails
    (else it would stay on for every later cell of the worker), then its results written where this
    torch has ``write_file`` (a torch without it appends each GEMM to the file as it is tuned)."""
    state = current()
    tunable = torch.cuda.tunable
    notes = [TUNABLEOP_SCOPE]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            notes.append(
                f"TunableOp started from the tunings already in {path.name} (an earlier run's or cell's): GEMMs "
                "tuned there are not tuned again, so one_off_ms is that of a warm file"
            )
        tunable.set_filename(str(path))  # before enabling: the file is read at the first tuned call
    if state.tunableop_used:  # its tunings stay in this process's memory
        notes.append(
            "TunableOp: an earlier cell of this worker process tuned GEMMs; those are not tuned again, so "
            "one_off_ms covers only this cell's new shapes"
        )
    try:
        tunable.enable(True)
        tunable.tuning_enable(True)
        state.tunableop_used = True
        yield
    finally:
        try:
            tunable.tuning_enable(False)
        finally:
            tunable.enable(False)
            if path is not None:
                row["tunableop_file"] = str(path)
                notes.append(_write_tunings(tunable, path))
            row["notes"] = "; ".join(n for n in notes if n)


def _write_tunings(tunable: Any, path: Path) -> str:
    """Write TunableOp's results to ``path`` now, where this torch has ``write_file``; else a note on how the file
    is written.  A torch without ``write_file`` (2.14 has none; its module docstring still says the file is written
    when the application terminates) appends every GEMM to the file as it is tuned (``Tunable.cpp``:
    ``TuningResultsManager::Add`` -> ``InitRealtimeAppend`` / ``AppendResultLine``; the destructor only closes it),
    so the file holds each tuning even when the worker is killed."""
    write = getattr(tunable, "write_file", None)
    if write is None:
        return (
            f"TunableOp appends each GEMM to {path.name} as it is tuned (this torch has no write_file; its realtime "
            "append), so the file holds every tuning even if the worker is killed"
        )
    try:
        write()
    except Exception as exc:  # the measurement stands; the file is what is lost
        return f"TunableOp could not write {path.name}: {type(exc).__name__}: {str(exc).strip()[:200]}"
    return ""


FIRST_CALL_LEVERS = {  # levers whose one-off cost is paid in the first calls, and what it is
    "compile": "torch.compile",
    "compile_teacher": "torch.compile (teacher)",
    "conv_autotune": "cuDNN/MIOpen algorithm search",
    "tunableop": "TunableOp GEMM tuning",
}


@dataclass
class LeverWatch:
    """A step measurement's levers that cost once, in its first calls: that cost (the cold and warm-up
    calls minus as many steady ones), and torch._dynamo's counters when something is compiled: graph
    breaks, graphs, frames compiled in the timed window.  ``chain`` wraps the timed loop's ``on_window``."""

    config: CellConfig
    window_frames: int = 0
    _start: int = 0

    def __post_init__(self) -> None:
        c = self.config
        self.kinds = [kind for lever, kind in FIRST_CALL_LEVERS.items() if getattr(c, lever) not in ("off", False)]
        generation = getattr(c, "on_policy", None) is not None and c.generation.compile  # its decode steps compiled
        if generation:
            self.kinds.append("decode compile (on-policy generation)")
        self.compiled = c.compile != "off" or c.compile_teacher or generation
        if self.compiled:
            torch._dynamo.reset()  # a model compiled by an earlier cell must not make this one look free
            _counters().clear()

    def chain(self, other: tuple[Callable[[], Any], Callable[[], Any]] | None):
        if not self.compiled:
            return other

        def start() -> None:
            quiesce_compile_workers()
            self._start = _counters()["frames"]["ok"]
            if other:
                other[0]()

        def end() -> None:
            if other:
                other[1]()
            self.window_frames = _counters()["frames"]["ok"] - self._start

        return start, end

    def columns(self, raw: RawTiming, median_ms: float) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if self.kinds:  # host time between synchronizations (RawTiming.first_calls_ms)
            row["one_off_ms"] = raw.cold_excess_ms(median_ms)
            row["one_off_kind"] = " + ".join(self.kinds)
        if self.compiled:
            counters = _counters()
            row["graph_breaks"] = int(sum(counters["graph_break"].values()))
            row["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
            row["recompiles"] = self.window_frames
        return row


def release_compiled(backend: Backend) -> None:
    """Drop what a compiled measurement left in this process before the next one's memory is watched:
    torch._dynamo's compiled code and, with it, the CUDA graph trees' memory pool (reduce-overhead and
    max-autotune keep it until the next reset), then the allocator's cached blocks."""
    torch._dynamo.reset()  # resets the CUDA graph trees too (torch >= 2.1)
    gc.collect()
    if backend.device.type == "cuda":
        torch.cuda.empty_cache()


def quiesce_compile_workers() -> None:
    """End inductor's pool of compile worker processes before a timed window.  The pool starts while the
    first call compiles and its workers import torch in the background for seconds after: on a small
    machine they would be timed with the model.  A later compile starts it again (and is a recompile)."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:  # another torch layout: nothing to quiesce that kdbench knows of
        return
    shutdown_compile_workers()


def _counters():
    from torch._dynamo.utils import counters

    return counters


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Compiled callables run eagerly inside (FLOP counting traces the eager ops, which are the same).
    The FLOP counter's module tracker hooks every module globally meanwhile, which torch.compile warns
    of: harmless here, so not shown."""
    stance = getattr(torch.compiler, "set_stance", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        if stance is None:  # torch < 2.6
            with torch._dynamo.config.patch(disable=True):
                yield
            return
        with stance("force_eager"):
            yield
