"""Derived columns, computed at read time from the stored rows: the one place they are defined.

Each needs rows other than its own, or a table that is not a measurement, so storing
it would mean rewriting earlier parts whenever a later one arrives:

* ``speedup_vs_teacher`` (student_inference rows): the teacher's median over the
  student's at the same batch size, in the same run, cell and repeat;
* ``scaling_efficiency`` (distill_step, world_size > 1): throughput over world_size
  times the throughput of the *twin* cell at world_size 1 in the same run;
* ``achieved_tflops``, ``datasheet_device``, ``datasheet_peak_tflops``, ``mfu`` and
  ``ceiling_utilization``: FLOPs per median time against the datasheet peak table
  (:mod:`kdbench.hw.peaks`) and the probe ceiling stored on the row; a step whose live
  teacher runs at another precision than its student against both precisions' peaks
  (:func:`effective_peak`);
* ``teacher_cache_saving_ms`` and ``teacher_cache_payback_steps`` (cached
  distill_step rows): against the twin cell with a live teacher in the same run;
* ``lever_baseline_ms``, ``lever_gain_ms`` and ``break_even_steps`` (rows with a
  ``one_off_ms``: compile, tuning, capture, export): against the same measurement of the
  twin cell that pulls no lever, in the same run.

Two cells are *twins* when their resolved configs (``config_json``) are equal but for
the settings being compared (:func:`twin_key`).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa

from kdbench.hw.peaks import datasheet_peak
from kdbench.names import PRECISIONS, Measurement, Status
from kdbench.store.schema import COLUMNS

WORLD_SIZE = (("world_size",), ("ddp",))  # a world_size 1 cell has no DDP options to compare
TEACHER_MODE = (("teacher", "mode"),)
LEVERS = (  # a cell's config stores a lever only when it is pulled (kdbench.config.plan.config_dict)
    ("compile",),
    ("compile_teacher",),
    ("graphs",),
    ("optimizer", "impl"),
    ("conv_autotune",),
    ("tunableop",),
    ("inference", "runtime"),
)


def twin_key(config_json: str | None, drop: tuple[tuple[str, ...], ...]) -> str | None:
    """The config as canonical JSON without the settings at the ``drop`` paths; None when unreadable."""
    try:
        config = json.loads(config_json)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for path in drop:
        node = config
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return json.dumps(config, sort_keys=True)


def payback_steps(one_off_ms, saving_ms) -> int | None:
    """Steps after which a per-step saving repays a one-off cost (rounded up); None when it never does."""
    if pd.isna(one_off_ms) or pd.isna(saving_ms) or saving_ms <= 0:
        return None
    return max(0, math.ceil(round(float(one_off_ms) / float(saving_ms), 9)))


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every derived column (re)computed; rows of any schema version."""
    df = df.reset_index(drop=True)
    for c in COLUMNS:
        if c.derived:  # strings as object (None), numbers as float (NaN), whatever an older file stored
            text = pa.types.is_string(c.type)
            df[c.name] = pd.Series(None if text else np.nan, index=df.index, dtype=object if text else float)
    if df.empty or "status" not in df:
        return df
    ok = df["status"].eq(Status.OK)
    _speedups(df, ok)
    _scaling(df, ok)
    _utilisation(df, ok)
    _cache_payback(df, ok)
    _break_even(df, ok)
    return df


def speedups(rows: list[dict]) -> dict[int, float]:
    """The student's speed-up over its teacher per batch size, among one job's stamped rows."""
    columns = ["run_id", "cell_id", "repeat", "batch_size", "measurement", "status", "median_ms"]
    df = pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=columns)
    df["median_ms"] = pd.to_numeric(df["median_ms"], errors="coerce")
    df["speedup_vs_teacher"] = np.nan
    _speedups(df, df["status"].eq(Status.OK))
    found = df[df["speedup_vs_teacher"].notna()]
    return dict(zip(found["batch_size"].astype(int), found["speedup_vs_teacher"].astype(float)))


def _speedups(df: pd.DataFrame, ok: pd.Series) -> None:
    key = ["run_id", "cell_id", "_repeat", "batch_size"]  # a repeat's student against the same repeat's teacher
    repeat = df["repeat"].fillna(1) if "repeat" in df else pd.Series(1, index=df.index)
    inference = df[ok & df["median_ms"].gt(0)].assign(_repeat=repeat)
    teacher = inference[inference["measurement"].eq(Measurement.TEACHER_INFERENCE)]
    teacher = teacher.drop_duplicates(key, keep="last").set_index(key)["median_ms"]
    students = inference[inference["measurement"].eq(Measurement.STUDENT_INFERENCE)]
    if students.empty or teacher.empty:
        return
    t = teacher.reindex(pd.MultiIndex.from_frame(students[key])).to_numpy(dtype=float)
    df.loc[students.index, "speedup_vs_teacher"] = t / students["median_ms"].to_numpy(dtype=float)


def _twins(df: pd.DataFrame, ok: pd.Series, drop) -> pd.DataFrame:
    """The ok distill_step rows with a readable config, with their twin ``key`` (run id included)."""
    steps = df[ok & df["measurement"].eq(Measurement.DISTILL_STEP) & df["config_json"].notna()]
    keys = steps["config_json"].map(lambda j: twin_key(j, drop))
    return steps.assign(key=steps["run_id"].astype(str) + "\0" + keys.astype(str))[keys.notna()]


def _scaling(df: pd.DataFrame, ok: pd.Series) -> None:
    steps = _twins(df, ok, WORLD_SIZE)
    single = steps[steps["world_size"].eq(1)].drop_duplicates("key", keep="last").set_index("key")["throughput"]
    multi = steps[steps["world_size"].gt(1)]
    if multi.empty or single.empty:
        return
    base = single.reindex(multi["key"]).to_numpy(dtype=float)
    df.loc[multi.index, "scaling_efficiency"] = multi["throughput"].to_numpy(dtype=float) / (
        multi["world_size"].to_numpy(dtype=float) * base
    )


def _peaks(rows: pd.DataFrame, precision: str) -> tuple[list, np.ndarray]:
    """Per row: the datasheet device matched (or None) and its dense peak at the row's ``precision``
    column (NaN if none), scaled to the compute units the row's device had."""
    units = rows.get("device_compute_units", pd.Series(np.nan, index=rows.index))
    arch = rows.get("device_arch", pd.Series(None, index=rows.index, dtype=object))
    keys = list(zip(rows["device_name"].fillna(""), rows[precision], units, arch))

    def peak(name, p, cus, a):
        if p not in PRECISIONS:
            return None
        cus = int(cus) if pd.notna(cus) else None
        return datasheet_peak(str(name), p, cus, a if isinstance(a, str) else None)

    table = {k: peak(*k) for k in set(keys)}
    matched = [table[k] for k in keys]
    return [m[0] if m else None for m in matched], np.array([m[1] if m else np.nan for m in matched], dtype=float)


def effective_peak(flops, teacher_flops, student_peak, teacher_peak):
    """The rate a step whose teacher forward (``teacher_flops`` of ``flops``) runs at one peak and the rest
    at another reaches at both peaks: total FLOPs over the time each part needs at its own peak
    (a FLOP-weighted harmonic mean).  NaN where either peak is unknown."""
    return flops / (teacher_flops / teacher_peak + (flops - teacher_flops) / student_peak)


def _utilisation(df: pd.DataFrame, ok: pd.Series) -> None:
    rows = df[ok & df["flops"].gt(0) & df["median_ms"].gt(0)]
    if rows.empty:
        return
    flops = rows["flops"].to_numpy(dtype=float)
    achieved = flops / (rows["median_ms"].to_numpy(dtype=float) / 1e3) / 1e12
    df.loc[rows.index, "achieved_tflops"] = achieved
    # A distillation step whose live teacher runs at another precision than the student is measured
    # against both precisions' peaks, each for its own share of the FLOPs.
    teacher_flops = rows["teacher_forward_flops"].to_numpy(dtype=float)
    mixed = (
        rows["measurement"].eq(Measurement.DISTILL_STEP).to_numpy()
        & (teacher_flops > 0)
        & rows["teacher_precision"].notna().to_numpy()
        & rows["teacher_precision"].ne(rows["precision"]).to_numpy()
    )
    devices, peak = _peaks(rows, "precision")
    _, teacher_peak = _peaks(rows, "teacher_precision")
    peak = np.where(mixed, effective_peak(flops, teacher_flops, peak, teacher_peak), peak)
    known = ~np.isnan(peak)
    df.loc[rows.index[known], "datasheet_device"] = [d for d, k in zip(devices, known) if k]
    df.loc[rows.index, "datasheet_peak_tflops"] = peak
    df.loc[rows.index, "mfu"] = achieved / peak
    ceiling = rows["ceiling_tflops"].to_numpy(dtype=float)
    teacher_ceiling = rows["teacher_ceiling_tflops"].to_numpy(dtype=float)
    ceiling = np.where(mixed, effective_peak(flops, teacher_flops, ceiling, teacher_ceiling), ceiling)
    df.loc[rows.index, "ceiling_utilization"] = np.where(ceiling > 0, achieved / ceiling, np.nan)


def _cache_payback(df: pd.DataFrame, ok: pd.Series) -> None:
    steps = _twins(df, ok, TEACHER_MODE)
    mode = steps["teacher_mode"].fillna("live")
    live = steps[mode.eq("live")].drop_duplicates("key", keep="last").set_index("key")["median_ms"]
    cached = steps[mode.eq("cached")]
    if cached.empty or live.empty:
        return
    saving = live.reindex(cached["key"]).to_numpy(dtype=float) - cached["median_ms"].to_numpy(dtype=float)
    df.loc[cached.index, "teacher_cache_saving_ms"] = saving
    df.loc[cached.index, "teacher_cache_payback_steps"] = [
        np.nan if (steps_ := payback_steps(one_off, s)) is None else float(steps_)
        for one_off, s in zip(cached["teacher_cache_ms"], saving)
    ]


def _break_even(df: pd.DataFrame, ok: pd.Series) -> None:
    rows = df[ok & df["config_json"].notna() & df["median_ms"].gt(0)]
    if rows.empty or not df["one_off_ms"].notna().any():
        return
    bare = rows["config_json"].map(lambda j: twin_key(j, ()))
    keys = rows["config_json"].map(lambda j: twin_key(j, LEVERS))
    where = rows["run_id"].astype(str) + "\0" + rows["measurement"].astype(str) + "\0" + rows["batch_size"].astype(str)
    key = where + "\0" + keys.astype(str)
    plain = rows[bare.eq(keys) & keys.notna()]  # cells that pull no lever
    base = plain.assign(key=key[plain.index]).drop_duplicates("key", keep="last").set_index("key")["median_ms"]
    pulled = rows[rows["one_off_ms"].notna() & bare.ne(keys)]
    if pulled.empty or base.empty:
        return
    baseline = base.reindex(key[pulled.index]).to_numpy(dtype=float)
    gain = baseline - pulled["median_ms"].to_numpy(dtype=float)
    df.loc[pulled.index, "lever_baseline_ms"] = baseline
    df.loc[pulled.index, "lever_gain_ms"] = gain
    df.loc[pulled.index, "break_even_steps"] = [
        np.nan if (n := payback_steps(one_off, g)) is None else float(n)
        for one_off, g in zip(pulled["one_off_ms"], gain)
    ]
