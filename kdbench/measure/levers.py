"""The levers a cell may pull beyond eager PyTorch, on the step side, and what each costs once.

* ``compile`` / ``compile_teacher``: ``torch.compile`` of the student's forward and backward
  (and of the teacher's forward) in the distillation step (:class:`kdbench.distill.step.Distiller`);
  the one-off cost is the compile time: the cold call and the warm-up calls (which may
  recompile) minus as many steady calls.  Graph breaks and compiled graphs come from
  ``torch._dynamo``'s counters, and frames compiled inside the timed window are counted
  as recompiles (a timed loop that recompiles measures the compiler).
* ``optimizer.impl``: ``default``, ``foreach`` or ``fused`` (:func:`kdbench.distill.step.make_optimizer`).
* ``conv_autotune``: ``torch.backends.cudnn.benchmark`` around the cell's measurements: cuDNN's
  algorithm search on NVIDIA, MIOpen's on ROCm (its find mode and databases come from the
  ``MIOPEN_*`` environment, recorded in ``env_knobs``); the search happens in the first calls.
* ``tunableop``: PyTorch's TunableOp GEMM tuning (``torch.cuda.tunable``) on ROCm and CUDA,
  its results file kept beside the results; the tuning happens in the first calls.
* ``graphs`` and ``inference.runtime``: how the student is served (:mod:`kdbench.measure.runtimes`).

GPU-only levers on the CPU make the cell ``skipped`` with a reason (:func:`skip_reason`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdbench.config.schema import CellConfig
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


def tunableop_file(results_dir: str | None, device_name: str) -> Path | None:
    """Where a run keeps TunableOp's results: beside the results, one file per device kind."""
    if results_dir is None:
        return None
    slug = "".join(ch if ch.isalnum() else "-" for ch in device_name).strip("-").lower() or "gpu"
    return Path(results_dir) / f"tunableop-{slug}.csv"


@contextlib.contextmanager
def device_levers(config: CellConfig, backend: Backend, tunable_path: Path | None = None) -> Iterator[dict]:
    """The cell's device-wide levers set for its measurements and restored after them; yields the columns
    that record them (filled in when the block ends)."""
    row: dict[str, Any] = {}
    if backend.device_type != "cuda":
        yield row
        return
    cudnn = torch.backends.cudnn
    saved = cudnn.benchmark
    cudnn.benchmark = config.conv_autotune  # set, not inherited: the default differs by build
    tunable = torch.cuda.tunable if config.tunableop else None
    try:
        if tunable is not None:
            tunable.enable(True)
            tunable.tuning_enable(True)
            if tunable_path is not None:
                tunable_path.parent.mkdir(parents=True, exist_ok=True)
                tunable.set_filename(str(tunable_path))
        yield row
    finally:
        cudnn.benchmark = saved
        if tunable is not None:
            if tunable_path is not None:
                tunable.write_file()
                row["tunableop_file"] = str(tunable_path)
            tunable.enable(False)


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
        self.compiled = c.compile != "off" or c.compile_teacher
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
        if self.kinds:
            calls = [raw.first_ms, *raw.warmup_ms]
            row["one_off_ms"] = max(0.0, sum(calls) - len(calls) * median_ms)
            row["one_off_kind"] = " + ".join(self.kinds)
        if self.compiled:
            counters = _counters()
            row["graph_breaks"] = int(sum(counters["graph_break"].values()))
            row["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
            row["recompiles"] = self.window_frames
        return row


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
