"""Will it fit, for a list of cells: each cell predicted (:mod:`.planner`, through a :class:`.verdict.Predictor` that
predicts each distinct cell once), judged against a device's usable memory and, with a size key, sized
(:mod:`.verdict`); the answer is a :class:`FitReport`, the same for ``kdbench fit`` and a notebook
(:func:`kdbench.api.fit` is the door).

The report's text is written here, line by line, and handed to ``talk`` as each line is known (the command line
prints them as they come: a suite's fake runs take minutes); :meth:`FitReport.record` is the JSON ``--out``
writes.  Nothing here prints.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdbench.config.plan import Cell
from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.sizes import gib
from kdbench.fit.devices import usable as usable_memory
from kdbench.fit.verdict import (
    SIZE_KEYS,
    UNPREDICTABLE,
    Largest,
    Predictor,
    Verdict,
    impls_to_size,
    judge,
    largest,
)

if TYPE_CHECKING:
    from kdbench.fit.devices import Device
    from kdbench.fit.planner import Prediction

PREDICTED = "predicted"  # the outcome of a predicted cell judged against no device (else unpredictable)
HEADER = (
    "kdbench fit: each cell's own distillation step (its pair, batch, loss and optimizer; 2 steps, the second "
    "with the optimizer's state) run on fake tensors: shapes and bytes only, nothing allocated; peaks per rank"
)


@dataclass
class CellFit:
    """One cell's answer: its prediction, the host figure, and against a device its verdict and the largest sizes
    that fit (one per loss implementation :func:`.verdict.impls_to_size` tries)."""

    cell_id: str
    label: str
    config: CellConfig
    prediction: Prediction
    host: str
    verdict: Verdict | None = None
    largest: list[tuple[CellConfig, Largest]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the cell's text, as the command line prints it
    record: dict[str, Any] = field(default_factory=dict)  # the cell's JSON record

    @property
    def outcome(self) -> str:
        """The verdict's outcome (fits, fits only with, does not fit, unpredictable); without a device, predicted
        or unpredictable."""
        if self.verdict is not None:
            return self.verdict.outcome
        return PREDICTED if self.prediction.error is None else UNPREDICTABLE


@dataclass
class FitReport:
    """Every cell's answer, in the plan's order, and how the predictions were made."""

    device: Device | None
    device_type: str  # "cuda" or "cpu": what the fake runs predicted for
    cells: list[CellFit]
    runs: int  # fake runs made (each distinct cell once)
    seconds: float
    lines: list[str]  # the whole text: header, each cell's lines, the summary

    @property
    def outcomes(self) -> dict[str, int]:
        """How many cells had each outcome, in the order each first came."""
        counts: dict[str, int] = {}
        for c in self.cells:
            counts[c.outcome] = counts.get(c.outcome, 0) + 1
        return counts

    @property
    def verdicts(self) -> dict[str, str]:
        """Cell id -> outcome."""
        return {c.cell_id: c.outcome for c in self.cells}

    def summary(self) -> str:
        counts = ", ".join(f"{n} {o}" for o, n in self.outcomes.items())
        return f"{len(self.cells)} cells: {counts}; {self.runs} fake runs in {self.seconds:.1f} s"

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def record(self) -> dict[str, Any]:
        """What ``kdbench fit --out FILE`` writes: the device, the device type and every cell's record."""
        device = None
        if self.device is not None:
            d = self.device
            device = {
                "name": d.name,
                "memory_bytes": d.memory_bytes,
                "total_bytes": d.total_bytes,
                "total_source": d.total_source,
                "free_bytes": d.free_bytes,
                "usable_bytes": d.usable_bytes,
                "kind": d.kind,
                "source": d.source,
                "note": d.note,
                "headroom": d.describe(),
            }
        return {"device": device, "device_type": self.device_type, "cells": [c.record for c in self.cells]}


def as_cells(items: Iterable[Cell | CellConfig]) -> list[Cell]:
    """Plan entries as they are; bare cell configs numbered in order, with their ids and labels as a plan whose
    matrix sweeps the settings in which they differ gives them."""
    from kdbench.config.plan import LABEL_KEYS, cell_id_of, distinct_labels

    items = list(items)
    if all(isinstance(item, Cell) for item in items):
        return items  # type: ignore[return-value]
    if not all(isinstance(item, CellConfig) for item in items):
        raise KdbenchError("fit: give cells of one kind: a plan's cells (kdbench.config.plan.Cell) or CellConfigs")
    cells = [Cell(i, cell_id_of(c), c) for i, c in enumerate(items)]
    return distinct_labels(cells, tuple(LABEL_KEYS))  # what differs between them shows, as a matrix's axes do


def fit_cells(
    cells: Iterable[Cell | CellConfig],
    device: Device | None,
    device_type: str,
    max_key: str | None = None,
    allow_imports: bool = False,
    talk: Callable[[str], None] | None = None,
    predictor: Predictor | None = None,
) -> FitReport:
    """Predict every cell for ``device_type``, judge it against ``device`` (None: predictions only) and, with
    ``max_key`` (``batch_size`` or ``seq_len``), find the largest size that fits; ``talk`` gets each line of the
    text as it is known."""
    if max_key is not None and max_key not in SIZE_KEYS:
        raise KdbenchError(f"max_key {max_key}: not a size key; it takes {' or '.join(SIZE_KEYS)}")
    if max_key and device is None:
        raise KdbenchError(f"max_key {max_key}: needs a device to fit into (a Device, or a GPU's name)")
    cells = as_cells(cells)
    runtime = device.runtime if device is not None and device_type != "cpu" else None  # its BLAS workspaces, NCCL
    predictor = predictor or Predictor(device_type, allow_imports=allow_imports, runtime=runtime)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if talk is not None:
            talk(line)

    say(HEADER)
    say(
        f"device {device.describe()}"
        if device
        else "no device given: predictions only (--gpu or --device-memory), a GPU's BLAS workspaces not in the peaks"
    )
    began = time.perf_counter()
    fitted = []
    for i, cell in enumerate(cells, 1):
        title = f"[{i}/{len(cells)}] {cell.label}  (cell {cell.cell_id})"
        fitted.append(_fit_cell(cell, device, max_key, predictor, title, say))
    report = FitReport(device, device_type, fitted, predictor.runs, time.perf_counter() - began, lines)
    say(report.summary())
    return report


def _fit_cell(cell: Cell, device, max_key, predictor: Predictor, title: str, say: Callable[[str], None]) -> CellFit:
    """Predict one cell, write its lines, judge it against ``device`` and size it with ``max_key``."""
    from kdbench.workloads import workload_of

    config = cell.config
    p = predictor(config)
    host = p.host or workload_of(config).host_footprint(config, predictor.device_type).summary(1)  # the dry run's
    out = CellFit(cell.cell_id, cell.label, config, p, host)
    out.record = {"cell_id": cell.cell_id, "label": cell.label, "prediction": dataclasses.asdict(p), "host": host}

    def line(text: str) -> None:
        out.lines.append(text)
        say(text)

    line(title)
    if p.ok:
        kinds = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in p.breakdown.items())
        logits = f"; logits {p.logits_bytes / p.peak_bytes:.0%} of it" if p.logits_bytes else ""
        line(f"      peak {gib(p.peak_bytes)} per rank in {p.phase} ({kinds} GiB){logits}")
        if p.comm_bytes:
            runtime = predictor.runtime
            line(
                f"      beside the peak: {runtime.comm} buffers {gib(p.comm_bytes)} per rank, outside the caching "
                f"allocator ({runtime.comm_text})"
            )
    notes = "".join(f"; {n}" for n in p.notes)
    ran = f"fake run {p.seconds:.1f} s{notes}" if p.seconds else ""
    if host or ran:
        line(f"      {'; '.join(t for t in (host, ran) if t)}")
    if device is None:
        if not p.ok:
            line(f"      unpredictable: {p.error}")
        return out

    def usable(prediction) -> int:  # what the device leaves this prediction's peak (its collective buffers kept off)
        return usable_memory(device, prediction.comm_bytes)

    verdict = out.verdict = judge(config, usable, predictor)
    line(f"      {verdict.line(usable)}")
    out.record["verdict"] = {
        "outcome": verdict.outcome,
        "line": verdict.line(usable),
        "changes": list(verdict.changes),
        "changed": dataclasses.asdict(verdict.changed) if verdict.changed is not None else None,
    }
    if max_key:
        out.record["largest"] = []
        variants = impls_to_size(config)
        for c in variants:
            found = largest(c, max_key, usable, predictor)
            out.largest.append((c, found))
            what = f" with loss_impl {c.loss_impl}" if len(variants) > 1 else ""
            line(f"      largest {max_key}{what}: {found.text()}  [{found.runs} fake runs]")
            out.record["largest"].append(
                {
                    "loss_impl": c.loss_impl,
                    "key": max_key,
                    "value": found.value,
                    "cap": found.cap,
                    "peak_bytes": found.prediction.peak_bytes if found.prediction is not None else None,
                    "above_peak_bytes": found.above.peak_bytes if found.above is not None else None,
                    "error": found.error,
                }
            )
    return out
