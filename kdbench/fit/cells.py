"""Will it fit, and what will it cost, for a list of cells: each cell predicted (:mod:`.planner`, one fake run per
distinct cell whatever the number of devices), judged against each device's usable memory and, with a size key,
sized (:mod:`.verdict`); on each GPU of the device table its step priced (:mod:`.cost`: the step time from the
fake run's operator census, what it processes per second, and for a budget the device-hours and their cost).  The
answer is a :class:`FitReport`, the same for ``kdbench fit`` and a notebook (:func:`kdbench.api.fit` is the door).

Several devices (``--gpu H100 --gpu MI300X``) share the fake runs: a device changes only the runtime terms
(:func:`kdbench.fit.runtime.with_runtime`: its BLAS workspaces, its collective buffers) laid over the same
prediction, and the step time is arithmetic on the same census.  The first device's prediction is the one the
cell's peak line prints; each device's verdict line says its own.

The report's text is written here, line by line, and handed to ``talk`` as each line is known (the command line
prints them as they come: a suite's fake runs take minutes); :meth:`FitReport.record` is the JSON ``--out``
writes.  Nothing here prints.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kdbench.config.plan import Cell
from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.sizes import gib
from kdbench.fit.cost import SAMPLES, TOKENS, Budget, DeviceTime, device_time, missing_figure, step_items
from kdbench.fit.devices import usable as usable_memory
from kdbench.fit.offline import check_epochs, offline_block
from kdbench.fit.verdict import (
    FITS,
    SIZE_KEYS,
    UNPREDICTABLE,
    Largest,
    Predictor,
    Sizes,
    Verdict,
    impls_to_size,
    judge,
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
    """One cell's answer: its prediction, the host figure, and against each device its verdict, the largest sizes
    that fit (one per loss implementation :func:`.verdict.impls_to_size` tries) and its predicted step."""

    cell_id: str
    label: str
    config: CellConfig
    prediction: Prediction
    host: str
    verdict: Verdict | None = None  # the first device's
    largest: list[tuple[CellConfig, Largest]] = field(default_factory=list)  # every device's, in device order
    lines: list[str] = field(default_factory=list)  # the cell's text, as the command line prints it
    record: dict[str, Any] = field(default_factory=dict)  # the cell's JSON record
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # device name -> verdict
    times: list[DeviceTime] = field(default_factory=list)  # the step on each GPU of the device table given

    @property
    def outcome(self) -> str:
        """The (first) verdict's outcome (fits, fits only with, does not fit, unpredictable); without a device,
        predicted or unpredictable."""
        if self.verdict is not None:
            return self.verdict.outcome
        return PREDICTED if self.prediction.error is None else UNPREDICTABLE


@dataclass
class FitReport:
    """Every cell's answer, in the plan's order, and how the predictions were made."""

    device: Device | None  # the first device (None: predictions only)
    device_type: str  # "cuda" or "cpu": what the fake runs predicted for
    cells: list[CellFit]
    runs: int  # fake runs made (each distinct cell once, for every device)
    seconds: float
    lines: list[str]  # the whole text: header, each cell's lines, the summary
    devices: list[Device] = field(default_factory=list)  # every device, in the order given
    budget: Budget | None = None
    epochs: float | None = None  # passes over a budget of tokens (the offline-teacher block's; None: 1)

    @property
    def outcomes(self) -> dict[str, int]:
        """How many cells had each outcome (against the first device), in the order each first came."""
        counts: dict[str, int] = {}
        for c in self.cells:
            counts[c.outcome] = counts.get(c.outcome, 0) + 1
        return counts

    @property
    def verdicts(self) -> dict[str, str]:
        """Cell id -> outcome (against the first device)."""
        return {c.cell_id: c.outcome for c in self.cells}

    def summary(self) -> str:
        ran = f"{self.runs} fake runs in {self.seconds:.1f} s"
        if len(self.devices) < 2:
            counts = ", ".join(f"{n} {o}" for o, n in self.outcomes.items())
            return f"{len(self.cells)} cells: {counts}; {ran}"
        each = []
        for d in self.devices:
            counts: dict[str, int] = {}
            for c in self.cells:
                o = c.verdicts[d.name].outcome if d.name in c.verdicts else c.outcome
                counts[o] = counts.get(o, 0) + 1
            each.append(f"{d.name} " + ", ".join(f"{n} {o}" for o, n in counts.items()))
        return f"{len(self.cells)} cells: {'; '.join(each)}; {ran}"

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def record(self) -> dict[str, Any]:
        """What ``kdbench fit --out FILE`` writes: the device (the first), every device, the budget, the device
        type and every cell's record."""
        devices = [_device_record(d) for d in self.devices]
        budget = None if self.budget is None else {"kind": self.budget.kind, "amount": self.budget.amount}
        if budget is not None and self.budget.kind == TOKENS:
            budget["epochs"] = 1 if self.epochs is None else self.epochs
        return {
            "device": devices[0] if devices else None,
            "devices": devices,
            "budget": budget,
            "device_type": self.device_type,
            "cells": [c.record for c in self.cells],
        }


def _device_record(d: Device) -> dict[str, Any]:
    card = d.card
    return {
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
        "price_per_hour": card.price if card is not None else None,
        "price_source": card.price_source if card is not None else "",
    }


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


class FakeRuns:
    """The planner's fake run (:func:`kdbench.fit.planner.predict`, or a stand-in), each distinct cell
    (:func:`kdbench.fit.planner.fake_run_key`: compile and timing settings aside) run once for every device:
    devices differ in the runtime terms laid over a prediction, not in the fake run. ``progress`` gets a line
    before each fake run: the cell, what the run changes of it (a lever, a batch) and the time so far (a suite's
    fake runs take minutes; the command line prints it to stderr)."""

    def __init__(self, predict: Callable[..., Any] | None = None, progress: Callable[[str], None] | None = None):
        if predict is None:
            from kdbench.fit.planner import predict
        self._predict = predict
        self._seen: dict[tuple[str, str], Any] = {}
        self.runs = 0
        self.progress = progress
        self.cell: tuple[str, CellConfig] | None = None  # the cell being fitted: its place and its own config
        self.began = time.perf_counter()
        self.ahead: Any = None  # kdbench.fit.ahead.Ahead: the cells' fake runs made on helper processes

    def __call__(self, config: CellConfig, device_type: str, allow_imports: bool = False):
        from kdbench.fit.planner import fake_run_key

        key = (fake_run_key(config), device_type)
        if key not in self._seen:
            self.runs += 1
            found = self.ahead.take(key) if self.ahead is not None else None
            if self.progress is not None:
                self.progress(self._says(config, found is not None))
            self._seen[key] = found if found is not None else self._predict(config, device_type, allow_imports)
        return self._seen[key]

    def run_ahead(self, configs: Iterable[CellConfig], device_type: str, allow_imports: bool) -> None:
        """The fake runs of ``configs`` started on helper processes (:func:`kdbench.fit.ahead.start`)."""
        from kdbench.fit.ahead import start

        self.ahead = start(self._predict, set(self._seen), configs, device_type, allow_imports, self.progress)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    def _says(self, config: CellConfig, ahead: bool = False) -> str:
        where, own = self.cell if self.cell is not None else ("", config)
        what = (difference(own, config) or "as given") + (", on a helper" if ahead else "")
        return f"fit: fake run {self.runs}, cell {where}: {what} ({elapsed(time.perf_counter() - self.began)} so far)"


def difference(base: CellConfig, config: CellConfig) -> str:
    """The settings of ``config`` that differ from ``base``'s, as ``loss_impl fused_linear, batch_size 4``."""
    a, b = _flat(base.model_dump(mode="json")), _flat(config.model_dump(mode="json"))
    return ", ".join(f"{k} {v}" for k, v in b.items() if a.get(k) != v)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def elapsed(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``."""
    return f"{seconds:.0f} s" if seconds < 60 else f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


class _DevicePredictor(Predictor):
    """One device's :class:`~kdbench.fit.verdict.Predictor` over :class:`FakeRuns` shared with the other devices:
    its ``runs`` is the fake runs made in all (a bisection's count is then the runs it really made)."""

    def __init__(self, device_type: str, shared: FakeRuns, allow_imports: bool, runtime: Any):
        super().__init__(device_type, shared, allow_imports=allow_imports, runtime=runtime)
        self._shared = shared
        self.runs = shared.runs

    def __call__(self, config: CellConfig):
        out = super().__call__(config)
        self.runs = self._shared.runs
        return out


def fit_cells(
    cells: Iterable[Cell | CellConfig],
    device: Device | Sequence[Device] | None,
    device_type: str,
    max_key: str | None = None,
    allow_imports: bool = False,
    talk: Callable[[str], None] | None = None,
    predictor: Predictor | None = None,
    budget: Budget | None = None,
    prices: Mapping[str, float] | None = None,
    progress: Callable[[str], None] | None = None,
    epochs: float | None = None,
) -> FitReport:
    """Predict every cell for ``device_type``, judge it against each of ``device`` (one or several; None:
    predictions only) and, with ``max_key`` (``batch_size`` or ``seq_len``), find the largest size that fits; on
    each GPU of the device table, price its step (:mod:`.cost`) and, with ``budget``, the budget's device-hours at
    the table's price or ``prices`` (card name -> USD per device-hour); ``talk`` gets each line of the text as it
    is known; ``progress`` a line before each fake run (:class:`FakeRuns`).  ``predictor`` (a stand-in's) serves
    every device.  With a budget of tokens and ``epochs`` (or a cell whose teacher is offline: 1 epoch if None), an
    LM cell also gets the offline-teacher decision for a corpus of that many tokens over ``epochs`` passes
    (:mod:`.offline`): one more fake run, its twin's."""
    devices = [] if device is None else list(device) if isinstance(device, Sequence) else [device]
    if max_key is not None and max_key not in SIZE_KEYS:
        raise KdbenchError(f"max_key {max_key}: not a size key; it takes {' or '.join(SIZE_KEYS)}")
    if max_key and not devices:
        raise KdbenchError(f"max_key {max_key}: needs a device to fit into (a Device, or a GPU's name)")
    if len({d.kind for d in devices}) > 1:
        raise KdbenchError(
            "--gpu cpu: this machine's memory is judged with a CPU's fake run; give it alone, not beside GPUs"
        )
    cells = as_cells(cells)
    check_budget(cells, devices, budget)
    check_epochs(epochs, budget)
    if predictor is not None:
        predictors = [predictor] * max(1, len(devices))
        runs: Callable[[], int] = lambda: predictor.runs  # noqa: E731
    else:
        shared = FakeRuns(progress=progress)
        predictors = [
            _DevicePredictor(device_type, shared, allow_imports, d.runtime if device_type != "cpu" else None)
            for d in devices
        ] or [_DevicePredictor(device_type, shared, allow_imports, None)]
        runs = lambda: shared.runs  # noqa: E731
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if talk is not None:
            talk(line)

    say(HEADER)
    for d in devices:
        say(f"device {d.describe()}")
    if not devices:
        say("no device given: predictions only (--gpu or --device-memory), a GPU's BLAS workspaces not in the peaks")
    if budget is not None:
        say(f"budget {budget.given}: device-hours = steps x predicted step time x world_size, at each device's price")
    if epochs is not None:
        say(f"epochs {epochs:g}: an LM cell's offline-teacher block totals {epochs:g} passes over the {budget.text()}")
    began = time.perf_counter()
    fitted = []
    try:
        if predictor is None:  # each cell as given, on helper processes while the loop below takes them in order
            shared.run_ahead([c.config for c in cells], device_type, allow_imports)
        for i, cell in enumerate(cells, 1):
            title = f"[{i}/{len(cells)}] {cell.label}  (cell {cell.cell_id})"
            if predictor is None:
                shared.cell = (f"{i}/{len(cells)}", cell.config)
            fitted.append(_fit_cell(cell, devices, max_key, predictors, title, say, budget, prices or {}, epochs))
    finally:
        if predictor is None:
            shared.close()
    report = FitReport(
        devices[0] if devices else None, device_type, fitted, runs(), time.perf_counter() - began, lines,
        devices, budget, epochs,
    )  # fmt: skip
    say(report.summary())
    return report


def check_budget(cells: list[Cell], devices: list[Device], budget: Budget | None) -> None:
    """A budget's mistakes, before any fake run: no GPU of the table to price it on, ``--tokens`` for a cell that
    counts samples, or a cell whose precision the only device has no peak for."""
    if budget is None:
        return
    if not devices:
        raise KdbenchError(f"{budget.given}: prices a step on a GPU of the device table; add --gpu NAME")
    for d in devices:
        if d.card is None or d.kind != "gpu":
            raise KdbenchError(
                f"{budget.given}: {d.name} is not a GPU of the device table (no peaks, no price); give --gpu NAME"
            )
    for i, cell in enumerate(cells, 1):
        if budget.kind == TOKENS and step_items(cell.config)[0] == SAMPLES:
            raise KdbenchError(
                f"{budget.given}: cell {i} ({cell.label}) counts samples, not tokens (an image pair); give a "
                "number of steps, --steps N"
            )
        if len(devices) == 1 and (why := missing_figure(devices[0].card, cell.config.precision)):
            raise KdbenchError(
                f"--gpu {devices[0].name}: {why}, and cell {i} ({cell.label}) runs {cell.config.precision}: "
                f"{budget.given} has no step time to price; give a --gpu with a {cell.config.precision} peak"
            )


def _prediction_record(p: Prediction) -> dict[str, Any]:
    """The prediction as JSON: its census as per phase and class totals (:meth:`kdbench.fit.census.Census.summary`),
    not every operator."""
    out = dataclasses.asdict(dataclasses.replace(p, census=None)) if hasattr(p, "census") else dataclasses.asdict(p)
    census = getattr(p, "census", None)
    out["census"] = census.summary() if census is not None else None
    return out


def _fit_cell(
    cell: Cell,
    devices: list[Device],
    max_key: str | None,
    predictors: list[Predictor],
    title: str,
    say: Callable[[str], None],
    budget: Budget | None,
    prices: Mapping[str, float],
    epochs: float | None = None,
) -> CellFit:
    """Predict one cell, write its lines, judge it against each device, size it with ``max_key`` and price its
    step on each GPU of the table (with a budget of tokens, an LM cell's offline-teacher decision too)."""
    from kdbench.workloads import workload_of

    config = cell.config
    first = predictors[0]
    p = first(config)
    host = p.host or workload_of(config).host_footprint(config, first.device_type).summary(1)  # the dry run's
    out = CellFit(cell.cell_id, cell.label, config, p, host)
    out.record = {"cell_id": cell.cell_id, "label": cell.label, "prediction": _prediction_record(p), "host": host}

    def line(text: str) -> None:
        out.lines.append(text)
        say(text)

    line(title)
    if p.ok:
        kinds = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in p.breakdown.items())
        logits = f"; logits {p.logits_bytes / p.peak_bytes:.0%} of it" if p.logits_bytes else ""
        on = f" on {devices[0].name}" if len(devices) > 1 else ""  # its runtime's workspaces; each verdict its own
        line(f"      peak {gib(p.peak_bytes)} per rank{on} in {p.phase} ({kinds} GiB){logits}")
        if p.comm_bytes:
            runtime = first.runtime
            line(
                f"      beside the peak: {runtime.comm} buffers {gib(p.comm_bytes)} per rank, outside the caching "
                f"allocator ({runtime.comm_text})"
            )
    notes = "".join(f"; {n}" for n in p.notes)
    ran = f"fake run {p.seconds:.1f} s{notes}" if p.seconds else ""
    if host or ran:
        line(f"      {'; '.join(t for t in (host, ran) if t)}")
    if not devices:
        if not p.ok:
            line(f"      unpredictable: {p.error}")
        return out
    several = len(devices) > 1
    searches = []  # per device: its searches, which its verdict and its --max lines share (fit.verdict.Sizes)
    for d, predictor in zip(devices, predictors):

        def usable(prediction, d=d) -> int:  # what the device leaves this prediction's peak (collective buffers off)
            return usable_memory(d, prediction.comm_bytes)

        sizes = Sizes(usable, predictor)
        searches.append(sizes)
        verdict = judge(config, usable, predictor, sizes)
        out.verdicts[d.name] = verdict
        if verdict.outcome != UNPREDICTABLE or not out.verdicts.keys() - {d.name}:  # unpredictable: said once
            line(f"      {d.name + ': ' if several and verdict.outcome != UNPREDICTABLE else ''}{verdict.line(usable)}")
        record = {
            "outcome": verdict.outcome,
            "line": verdict.line(usable),
            "changes": list(verdict.changes),
            "changed": _prediction_record(verdict.changed) if verdict.changed is not None else None,
            "others": [{"changes": list(o.changes), "peak_bytes": o.prediction.peak_bytes} for o in verdict.others],
            "as_is_batch_size": verdict.as_is.value if verdict.as_is is not None else None,
        }
        out.record.setdefault("verdicts", {})[d.name] = record
        if out.verdict is None:
            out.verdict, out.record["verdict"] = verdict, record
    _step_times(out, devices, predictors, budget, prices, line)
    # the offline twin's fake run only where asked (--epochs) or where the cell is offline: a plain --tokens prices the
    # cell as given, one fake run, as fast as issue 43 wants a suite's fit
    if budget is not None and budget.kind == TOKENS and (epochs is not None or out.config.teacher.mode == "offline"):
        offline_block(out, devices, predictors, budget, 1 if epochs is None else epochs, prices, line)
    if max_key:
        out.record["largest"] = []
        variants = impls_to_size(config)
        for d, sizes in zip(devices, searches):
            for c in variants:
                found = sizes.largest(c, max_key)
                out.largest.append((c, found))
                what = f" with loss_impl {c.loss_impl}" if len(variants) > 1 else ""
                on = f" on {d.name}" if several else ""
                line(f"      largest {max_key}{what}{on}: {found.text()}  [{found.runs} fake runs]")
                out.record["largest"].append(
                    {
                        "device": d.name,
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


def _step_times(
    out: CellFit,
    devices: list[Device],
    predictors: list[Predictor],
    budget: Budget | None,
    prices: Mapping[str, float],
    line: Callable[[str], None],
) -> None:
    """The cell's predicted step on each GPU of the table given (arithmetic on its census: no fake run), one line a
    device, names aligned; with several priced devices and a budget, the cheapest and the fastest where it fits."""
    priced = [(d, q) for d, q in zip(devices, predictors) if d.card is not None and d.kind == "gpu"]
    if not priced or not out.prediction.ok:
        return
    width = max(len(d.name) for d, _ in priced)
    for d, predictor in priced:
        price = (prices[d.card.name], "given: --price") if d.card.name in prices else None
        t = device_time(predictor(out.config), out.config, d.card, budget, price)
        out.times.append(t)
        fits = out.verdicts[d.name].outcome == FITS
        line(f"      step on {d.name:<{width}}  {t.text()}" + ("" if fits or t.ms is None else "  [as given: no fit]"))
    out.record["step_time"] = [t.record() for t in out.times]
    known = [t for t in out.times if t.ms is not None and out.verdicts[t.device].outcome == FITS]
    if len(known) > 1 and budget is not None:
        fastest = min(known, key=lambda t: t.ms)
        costs = [t for t in known if t.cost is not None]
        cheapest = f"cheapest {min(costs, key=lambda t: t.cost).device}; " if costs else ""
        line(f"      {budget.text()}: {cheapest}fastest {fastest.device} (of the devices it fits as given)")
