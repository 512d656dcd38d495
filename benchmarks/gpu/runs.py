"""``kdbench`` as the check runs it: in a subprocess whose output is printed (and so kept in check.log) as it
comes, a suite run into the scratch folder and its rows read back, ``--quick``'s subsets of the image suites,
and the reading of a row's optional fields (a null reads as None or NaN)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from kdbench.config.load import load_suite
from kdbench.hw.backends import Backend
from kdbench.hw.contention import OWN_CONTEXTS_ENV, RUN_PID_ENV
from kdbench.store.results import read_results
from kdbench.workloads import expand_checked, planned_measurements

from .plan import ROOT
from .report import Report


def run_kdbench(report: Report, *args: str) -> bool:
    """``python -m kdbench ARGS``, its output printed (and so in check.log) as it comes."""
    command = [sys.executable, "-m", "kdbench", *args]
    report.info("$ " + " ".join(command))
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}
    # this process holds a GPU context of its own (the in-process stages): the run is rooted here, so the check is
    # one of the run's processes, not another process on the device (GPU review 4, M8); where the driver lists host
    # pids (a container), the run's rows subtract this one context
    env[RUN_PID_ENV] = str(os.getpid())
    env[OWN_CONTEXTS_ENV] = "1"
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    )
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
        sys.stdout.flush()
        code = proc.wait()
    finally:
        if proc.poll() is None:  # stopped (SIGTERM, Ctrl-C): the child goes too
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
    return report.check(f"kdbench {args[0]} exit code {code} ({time.perf_counter() - start:.0f} s)", code == 0)


def subset_suite(suite: Path, keep: Callable[[dict], bool], folder: Path, name: str) -> Path:
    """A copy of ``suite`` with only the ``matrix.cases`` that ``keep`` accepts, written into ``folder``
    (``kdbench run`` has no cell filter); the suite itself when it has no cases axis."""
    raw = yaml.safe_load(suite.read_text())
    cases = (raw.get("matrix") or {}).get("cases")
    if not isinstance(cases, list):
        return suite
    raw["matrix"]["cases"] = [c for c in cases if keep(c or {})]
    raw["name"] = name
    raw["description"] = f"{raw.get('description', '')} (--quick: {len(raw['matrix']['cases'])} of {len(cases)} cases)"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def quick_smoke_case(case: dict) -> bool:
    """--quick's gpu-smoke cells: CIFAR fp32 and tf32, and the resnet50->resnet18 bf16 step the summary reads."""
    pair = case.get("pair") or {}
    if not pair:
        return case.get("precision") in ("fp32", "tf32")
    return case.get("precision") == "bf16" and pair.get("student") == "resnet18"


def quick_lever_case(case: dict) -> bool:
    """--quick's gpu-levers cells: all but the compiles, bar compile_teacher's graph-tree path (gpu-review-2 G3), and
    but TunableOp, whose GEMM search is the slowest lever after a compile (the LM stage's decode compile and the fit
    stage took its time in the device command: GPU review 4, M6, M11)."""
    return ("compile" not in case or bool(case.get("compile_teacher"))) and not case.get("tunableop")


def run_suite(backend: Backend, suite: Path, scratch: Path, report: Report, cell_timeout: float):
    """``kdbench run`` of a suite into scratch/results/<suite name>/ (where the probe's ceiling is found);
    its rows, checked to be every planned measurement, or None when the run failed."""
    loaded = load_suite(suite)
    planned = loaded.repeat * sum(len(planned_measurements(c.config)) for c in expand_checked(loaded))
    results = scratch / "results"
    command = ["run", str(suite), "--out", str(results), "--device", backend.name, "--no-report"]
    command += ["--run-id", loaded.name, "--cell-timeout", f"{cell_timeout:g}"]
    run_kdbench(report, *command)
    if not (results / loaded.name).is_dir():
        return None
    df = read_results([results / loaded.name])
    if "timestamp" in df:
        df = df.sort_values("timestamp", kind="stable")  # the order they were measured in
    report.check(f"{len(df)} rows stored of {planned} planned (exit code aside)", len(df) == planned)
    return df


def ok_rows(df: pd.DataFrame, report: Report) -> list[tuple[Any, str]]:
    """A run's rows that are ``ok``, each with its label; every other row is checked here: a skip with its reason
    passes, anything else fails."""
    rows = []
    for r in df.itertuples():
        what = f"{r.cell_label} {r.measurement} bs{r.batch_size}"
        if r.status != "ok":
            report.check(f"{what}: {r.status}: {r.error}", r.status == "skipped" and said(r.error))
        else:
            rows.append((r, what))
    return rows


def step_time_text(r: Any) -> str:
    """A step row's step-time prediction beside its measurement (issue 43: the model checked on every GPU step the
    check runs): ``, predicted X ms (measured/predicted R)``, or what the row says instead."""
    predicted = getattr(r, "predicted_step_ms", None)
    if predicted is None or pd.isna(predicted):
        return ", step time not predicted"
    ratio = getattr(r, "predicted_step_ratio", None)
    return f", predicted {predicted:.4g} ms" + (f" (measured/predicted {ratio:.2f})" if pd.notna(ratio) else "")


def count_or_na(value: Any) -> str:
    return "n/a" if value is None or pd.isna(value) else str(int(value))


def said(reason: Any) -> bool:
    """A reason is there: a non-empty string (a null reads as None or NaN)."""
    return isinstance(reason, str) and bool(reason.strip())


def truthy(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and pd.isna(value)) and bool(value)
