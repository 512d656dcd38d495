"""kdbench as a library: what the command line calls, and what a script or notebook may call too.

    from kdbench import api
    suite = api.load_suite("suites/cpu.yaml")
    outcome = api.run_suite(suite, api.RunOptions(out_dir=Path("results")))
    api.render([outcome.path], "reports")

Will each cell of a suite fit an H200, and what is the largest batch that does?

    report = api.fit("suites/llm-cuda.yaml", "H200", max_key="batch_size")
    report.verdicts  # cell id -> fits / fits only with / does not fit / unpredictable

``render``, ``compare`` and ``quality_table`` read parquet only and never import torch; the others
import it when called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdbench.config.budgets import BudgetCheck
    from kdbench.config.schema import Suite
    from kdbench.config.suite_times import SuiteTime
    from kdbench.fit.cells import FitReport
    from kdbench.fit.cost import Budget
    from kdbench.fit.devices import Device
    from kdbench.report.compare.verdicts import Comparison
    from kdbench.run.engine import RunOptions, RunOutcome
    from kdbench.run.plan import Plan


def load_suite(path: str | Path) -> Suite:
    from kdbench.config import load_suite as load

    return load(path)


def plan(suite: Suite, shard: tuple[int, int] | None = None, device: str | None = None) -> Plan:
    """The jobs a run of ``suite`` would run (its cells, then the quality job), checked; nothing runs.
    ``device`` overrides the suite's backend, as ``run --device`` does."""
    from kdbench.run.plan import plan_jobs, planned_backend

    return plan_jobs(suite, shard, planned_backend(suite, device))


def run_suite(
    suite: Suite, options: RunOptions | None = None, plan: Plan | None = None, close: bool = True
) -> RunOutcome:
    """Run the suite (see :func:`kdbench.run.engine.run_suite`)."""
    from kdbench.run.engine import RunOptions, run_suite

    return run_suite(suite, options or RunOptions(), plan, close)


def render(
    results: Iterable[str | Path],
    out_dir: str | Path,
    title: str | None = None,
    baseline: str | Path | None = None,
    threshold: float = 0.05,
) -> Path:
    """The HTML/PNG report of result files, run folders or folders of runs; the page's path.

    With ``baseline`` (a run folder or result file), every run is compared with it (its rows are drawn
    too); without, every run after the first is compared with the first when they share cells (the
    same suite on two machines).  Budgets stored with the runs are checked and shown."""
    import pandas as pd

    from kdbench.report import render_report
    from kdbench.report.compare.compare import side_by_side
    from kdbench.store import read_results
    from kdbench.store.results import UNREADABLE, run_states

    results = list(results)
    df = read_results(results)
    base = None
    if baseline is not None:
        base = read_results([baseline])
        unreadable = [*base.attrs.get(UNREADABLE, []), *df.attrs.get(UNREADABLE, [])]
        df = pd.concat([base, df[~df["run_id"].isin(set(base["run_id"]))]], ignore_index=True)
        df.attrs[UNREADABLE] = unreadable  # the parts left out of either, named on the page
        results.append(baseline)
    states = run_states(results)
    comparisons = side_by_side(df, base, threshold, states=states)
    return render_report(df, out_dir, title, comparisons, budget_checks(results), states, threshold)


def compare(
    base: str | Path,
    new: str | Path,
    threshold: float = 0.05,
    confidence: float = 0.95,
    policy=None,
    rerun_undecided: int = 0,
    rerun_sides: str = "both",
    base_code: str | Path | None = None,
) -> Comparison:
    """NEW against BASE (each a run folder or result file), cell by cell: :mod:`kdbench.report.compare.compare`.
    ``threshold`` is a fraction (0.05: 5 %); ``policy`` (:class:`kdbench.report.compare.verdicts.Policy`) what else
    fails the gate; ``.exit_code`` is 1 when a measurement fails it.  With ``rerun_undecided`` N, up to N
    rounds measure the undecided cells again (:mod:`kdbench.run.rerun`: the sides ``rerun_sides``, "both" or
    "new", that can be measured here; BASE's from the code in ``base_code`` first) in a sequential design
    (:class:`kdbench.report.compare.compare.Sequential`)."""
    from kdbench.report.compare.compare import Sequential, compare_frames
    from kdbench.store import read_results
    from kdbench.store.results import run_states

    def state(path):
        states = list(run_states([path]).values())
        return states[0] if len(states) == 1 else None

    def look(level: float) -> Comparison:
        return compare_frames(
            read_results([base]),
            read_results([new]),
            threshold,
            level,
            base_label=str(base),
            new_label=str(new),
            policy=policy,
            base_state=state(base),
            new_state=state(new),
        )

    if base_code is not None and (not rerun_undecided or rerun_sides != "both"):
        from kdbench.core.errors import KdbenchError

        raise KdbenchError(
            "--base-code gives the code BASE's new repeats run: use it with --rerun-undecided N and both sides "
            "measured again (not --rerun-sides new)"
        )
    if not rerun_undecided:
        return look(confidence)
    sequence = Sequential(confidence, rerun_undecided)
    first = look(sequence.level(1))
    sides, note = _rerun_sides(first, base, new, rerun_sides, base_code)
    sequence.lines += [note] if note else []
    cmp, number = first, 1
    while True:
        cells = sequence.fold(cmp, number)
        if not cells:
            return cmp
        from kdbench.run.rerun import measure_again

        measure_again(sides, cells, number)
        number += 1
        cmp = look(sequence.level(number))


def _rerun_sides(cmp: Comparison, base, new, which: str, base_code=None) -> tuple[list, str]:
    """The sides ``compare --rerun-undecided`` measures again and a note on a side left out; KdbenchError when
    none can be (the reasons)."""
    from kdbench.core.errors import KdbenchError
    from kdbench.run.rerun import side, why_not
    from kdbench.store import read_results

    if cmp.same_run:
        raise KdbenchError(f"--rerun-undecided: BASE and NEW are {cmp.same_run}; give the run to judge as NEW")
    sides, reasons = [], []
    for name, path in (("BASE", base), ("NEW", new)):
        if name == "BASE" and which == "new":
            continue
        rows = read_results([path])
        why = why_not(name, Path(path), rows)
        if why:
            reasons.append(why)
        else:
            sides.append(side(name, Path(path), rows, base_code if name == "BASE" else None))
    if not sides:
        raise KdbenchError(f"--rerun-undecided: no side can be measured again here: {'; '.join(reasons)}")
    left_out = "BASE is not measured again (--rerun-sides new)" if which == "new" else "; ".join(reasons)
    return sides, (f"only {sides[0].name} is measured again: {left_out}" if len(sides) == 1 else "")


def fit(
    cells: Suite | str | Path | Iterable,
    device: Device | str | Iterable[Device | str] | None = None,
    max_key: str | None = None,
    allow_imports: bool = False,
    talk: Callable[[str], None] | None = None,
    tokens: str | int | None = None,
    steps: int | None = None,
    prices: dict[str, float] | None = None,
    budget: Budget | None = None,
    progress: Callable[[str], None] | None = None,
    epochs: float | None = None,
) -> FitReport:
    """Will it fit, and what will it cost (``kdbench fit``): each cell's peak memory per rank predicted by a fake
    run of its own step, judged against ``device`` and, with ``max_key`` (``batch_size`` or ``seq_len``), the
    largest size that fits; on each GPU of the device table, the step's predicted time and, for a budget of
    ``tokens`` (``"10B"``, ``1e9``: an LM cell's) or ``steps``, the device-hours and their cost.

    ``cells``: a suite (or its file: its cells as a run plans them) or cells (``CellConfig`` or a plan's ``Cell``,
    predicted for a GPU); ``device``: a :class:`kdbench.fit.devices.Device` (``sized_device("80GB")``), a GPU's
    name, several of them (one fake run per cell serves them all), or None for predictions only;
    ``allow_imports``: build ``module:callable`` models (a suite's own setting otherwise); ``talk`` gets each line
    of the report's text as it is known (the command line prints it); ``prices``: US dollars per device-hour by
    device name (the table's otherwise); ``budget``: a :class:`kdbench.fit.cost.Budget` as the command line parses
    one, instead of ``tokens`` or ``steps``; ``progress`` gets a line before each fake run (what it tries, the time
    so far: the command line prints them to stderr); ``epochs``: passes over a budget of ``tokens`` (default 1),
    for an LM cell's offline-teacher block (:mod:`kdbench.fit.offline`: disk, build, saving, pay-back, memory freed,
    the E-epoch totals).  The :class:`kdbench.fit.cells.FitReport` has each cell's prediction, verdicts, sizes and
    step times, its text and its JSON record."""
    from kdbench.config.schema import Suite
    from kdbench.core.devices import find_card
    from kdbench.core.errors import KdbenchError
    from kdbench.fit.cells import fit_cells
    from kdbench.fit.cost import parse_tokens, steps_budget
    from kdbench.fit.devices import find_device

    many = device is not None and not isinstance(device, str) and isinstance(device, Iterable)
    devices = [find_device(d, flag="device") if isinstance(d, str) else d for d in (device if many else [device])]
    devices = [d for d in devices if d is not None]
    if tokens is not None and steps is not None:
        raise KdbenchError(f"tokens {tokens} and steps {steps}: give one budget, tokens or steps")
    budget = parse_tokens(str(tokens), "tokens") if tokens is not None else budget
    budget = steps_budget(steps, "steps") if steps is not None else budget
    by_card = {}
    for name, usd in (prices or {}).items():
        card = find_card(name)
        if card is None:
            raise KdbenchError(f"prices {name}: unknown device; give a name of the device table (H100, MI300X ...)")
        by_card[card.name] = float(usd)
    backend = "cuda"  # bare cells are predicted for a GPU, as `kdbench fit --pair` does
    if isinstance(cells, Suite | str | Path):
        from kdbench.config import with_overrides

        suite = load_suite(cells) if isinstance(cells, str | Path) else cells
        suite = with_overrides(suite, {"allow_imports": ("--allow-imports", True if allow_imports else None)})
        cells, backend, allow_imports = plan(suite).cells, suite.backend, bool(suite.allow_imports)
    kind = devices[0].kind if devices else backend
    device_type = "cpu" if kind == "cpu" else "cuda"
    one = devices[0] if len(devices) == 1 else devices or None
    return fit_cells(
        cells, one, device_type, max_key, allow_imports, talk, budget=budget, prices=by_card, progress=progress,
        epochs=epochs,
    )  # fmt: skip


def budget_checks(results: Iterable[str | Path], judge_contended: bool = False) -> list[BudgetCheck]:
    """Every budget check of the runs in ``results``: each run against the budgets its manifest stored (rows
    measured on a busy machine left out unless ``judge_contended``)."""
    from kdbench.config.budgets import budgets_of, check
    from kdbench.store import read_results
    from kdbench.store.results import result_files, run_budgets

    results = list(results)
    stored = run_budgets(result_files(results))
    if not stored:
        return []
    df = read_results(results)
    return [
        c
        for run_id, raw in stored.items()
        for c in check(df[df["run_id"].eq(run_id)], budgets_of(raw), judge_contended)
    ]


def quality_table(results: Iterable[str | Path]) -> str:
    """The Markdown table of the quality rows in ``results`` (mean ± std over seeds), and a line under it when some
    come from models an earlier invocation of their run trained and kept (:mod:`kdbench.quality.checkpoints`)."""
    from kdbench.core.names import Measurement
    from kdbench.report.summaries import markdown_drafts, markdown_table, summarize_drafts, summarize_quality
    from kdbench.store import read_results

    df = read_results(results)
    table = markdown_table(summarize_quality(df))
    quality = df[df["measurement"].eq(Measurement.QUALITY)] if "measurement" in df else df.iloc[:0]
    reused = int(quality["notes"].fillna("").str.contains("reused: trained by an earlier invocation").sum())
    if reused:
        table += (
            f"{reused} of the {len(quality)} rows come from models an earlier invocation of the run trained and kept: "
            "their training times are that invocation's (each row's notes name its checkpoint)\n"
        )
    drafts = markdown_drafts(summarize_drafts(quality))
    if drafts:
        table += (
            "\nThe students as drafts of their seed's teacher in speculative decoding, per draft length γ (mean ± std "
            "over seeds; in bold the highest mean α and measured speed-up at each γ: the best draft):\n\n" + drafts
        )
    return table


SUITES_DIR = Path(__file__).resolve().parents[1] / "suites"  # the shipped suites, beside the package in a clone


@dataclass(frozen=True)
class ShippedSuite:
    """A suite file of the suites folder: its name, cells, description and recorded time (None: no entry in
    times.toml)."""

    file: str
    name: str
    cells: int
    quality: bool  # the quality block's job follows the cells
    description: str
    time: SuiteTime | None

    @property
    def count(self) -> str:
        """``8``, or ``8 + quality`` (the quality block's job after the cells)."""
        return f"{self.cells} + quality" if self.quality else str(self.cells)


def shipped_suites(folder: str | Path | None = None) -> list[ShippedSuite]:
    """Every suite of ``folder`` (default: :data:`SUITES_DIR`; loaded and expanded, nothing runs), in the order of
    its times.toml, then by file name; a KdbenchError when the folder is missing (kdbench installed without its
    repository)."""
    from kdbench.config import load_suite
    from kdbench.config.suite_times import suite_times
    from kdbench.core.errors import KdbenchError
    from kdbench.workloads import expand_checked

    folder = Path(folder if folder is not None else SUITES_DIR)
    if not folder.is_dir():
        raise KdbenchError(
            f"{folder}: no suites folder; the shipped suites are in a clone of kdbench's repository (suites/)"
        )
    times = suite_times(folder)
    files = {p.name: p for p in folder.glob("*.yaml")}
    order = [f for f in times if f in files] + sorted(f for f in files if f not in times)
    out = []
    for name in order:
        suite = load_suite(files[name])
        cells = len(expand_checked(suite))
        out.append(ShippedSuite(name, suite.name, cells, suite.quality is not None, suite.description, times.get(name)))
    return out


def __getattr__(name: str):
    """``api.RunOptions`` without importing the run engine (and torch) with this module."""
    if name == "RunOptions":
        from kdbench.run.engine import RunOptions

        return RunOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
