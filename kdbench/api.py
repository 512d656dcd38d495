"""kdbench as a library: what the command line calls, and what a script or notebook may call too.

    from kdbench import api
    suite = api.load_suite("suites/cpu.yaml")
    outcome = api.run_suite(suite, api.RunOptions(out_dir=Path("results")))
    api.render([outcome.path], "reports")

``render``, ``compare`` and ``quality_table`` read parquet only and never import torch; the others
import it when called.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdbench.config.budgets import BudgetCheck
    from kdbench.config.schema import Suite
    from kdbench.report.verdicts import Comparison
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
    from kdbench.report.compare import side_by_side
    from kdbench.store import read_results
    from kdbench.store.results import run_states

    results = list(results)
    df = read_results(results)
    base = None
    if baseline is not None:
        base = read_results([baseline])
        df = pd.concat([base, df[~df["run_id"].isin(set(base["run_id"]))]], ignore_index=True)
        results.append(baseline)
    states = run_states(results)
    comparisons = side_by_side(df, base, threshold, states=states)
    return render_report(df, out_dir, title, comparisons, budget_checks(results), states, threshold)


def compare(
    base: str | Path, new: str | Path, threshold: float = 0.05, confidence: float = 0.95, policy=None
) -> Comparison:
    """NEW against BASE (each a run folder or result file), cell by cell: :mod:`kdbench.report.compare`.
    ``threshold`` is a fraction (0.05: 5 %); ``policy`` (:class:`kdbench.report.verdicts.Policy`) what else
    fails the gate; ``.exit_code`` is 1 when a measurement fails it."""
    from kdbench.report.compare import compare_frames
    from kdbench.store import read_results
    from kdbench.store.results import run_states

    def state(path):
        states = list(run_states([path]).values())
        return states[0] if len(states) == 1 else None

    return compare_frames(
        read_results([base]),
        read_results([new]),
        threshold,
        confidence,
        base_label=str(base),
        new_label=str(new),
        policy=policy,
        base_state=state(base),
        new_state=state(new),
    )


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
    """The Markdown table of the quality rows in ``results`` (mean ± std over seeds)."""
    from kdbench.report.summaries import markdown_table, summarize_quality
    from kdbench.store import read_results

    return markdown_table(summarize_quality(read_results(results)))


def __getattr__(name: str):
    """``api.RunOptions`` without importing the run engine (and torch) with this module."""
    if name == "RunOptions":
        from kdbench.run.engine import RunOptions

        return RunOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
