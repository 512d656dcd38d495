"""Derived columns, computed at read time from the stored rows: the one place they are defined.

Each needs rows other than its own, or a table that is not a measurement, so storing
it would mean rewriting earlier parts whenever a later one arrives:

* ``thin`` where an older row lacks it: fewer timed calls than ``min_iters``;
* ``speedup_vs_teacher`` (student_inference rows): the teacher's median over the
  student's at the same batch size, in the same run, cell and repeat;
* ``spec_speedup``, ``spec_cost_ratio``, ``spec_predicted_speedup`` and ``spec_predicted_tokens_per_verify``
  (speculative_decode rows): against the batch-size-1 teacher_decode and student_decode rows of the same run, cell
  and repeat (:func:`_speculative`);
* ``scaling_efficiency`` (distill_step, world_size > 1): throughput over world_size
  times the throughput of the *twin* cell at world_size 1 in the same run and repeat;
* ``achieved_tflops``, ``datasheet_device``, ``datasheet_peak_tflops``, ``mfu`` and
  ``ceiling_utilization``: FLOPs per median time against the datasheet peak table
  (:mod:`kdbench.core.devices`) and the probe ceiling stored on the row; a step whose live
  teacher runs at another precision than its student against both precisions' peaks
  (:func:`effective_peak`);
* ``bandwidth_share`` and ``floor_ms_per_token`` (decode rows): the bytes each generated token must read
  (``decode_bytes_per_token``) against the probe's copy bandwidth stored on the row (``ceiling_gbps``);
* ``teacher_cache_saving_ms`` and ``teacher_cache_payback_steps`` (cached
  distill_step rows): against the twin cell with a live teacher in the same run and repeat;
* ``lever_baseline_ms``, ``lever_gain_ms`` (with ``lever_gain_low_ms`` / ``_high_ms``),
  ``lever_one_off_net_ms`` and ``break_even_steps`` (with ``break_even_low_steps`` /
  ``_high_steps``) for rows with a ``one_off_ms`` (compile, tuning, capture, export): against
  the same measurement of the twin cell that pulls no lever, in the same run, repeat by
  repeat (two cells of one round ran in the same worker process), pooled over the repeats:
  the gain's paired t-interval carried into a break-even range, the one-off cost net of the
  twin's own cold-call excess; decode rows' ``break_even_tokens``: the break-even in generated tokens.

Two cells are *twins* when their resolved configs (``config_json``) are equal but for
the settings being compared (:func:`twin_key`); :func:`match_twins` pairs their rows, the one
matching for scaling, cache pay-back and break-even.  Thin rows (shrunk by a time budget) are
never matched.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa

from kdbench.core.devices import datasheet_peak
from kdbench.core.names import PRECISIONS, SERVING, Measurement, Status, counterpart, role_of
from kdbench.core.schema import COLUMNS
from kdbench.core.speculation import expected_tokens_per_verify, predicted_speedup
from kdbench.core.stats.repeats import centre, paired_t

DECODE = (Measurement.STUDENT_DECODE, Measurement.TEACHER_DECODE)
# A world_size 1 cell has no DDP or FSDP options to compare: an FSDP2 cell's twin is the same single-device cell
WORLD_SIZE = (("world_size",), ("ddp",), ("parallel",), ("fsdp",))
TEACHER_MODE = (
    ("teacher", "mode"),
    ("teacher", "k"),
    *(
        ("teacher", key)
        for key in ("store", "values", "indices", "compression", "top_p", "store_tokens", "page_cache", "corpus")
    ),
)
# An offline cell at world_size > 1 (DDP: its steps run no teacher) against a live twin that shards its teacher with
# FSDP2 (the twin a teacher too large for one device needs): the same cell but for the teacher mode and parallelism
PARALLEL = (("parallel",), ("ddp",), ("fsdp",))
LEVERS = (  # a cell's config stores a lever only when it is pulled (kdbench.config.plan.config_dict)
    ("compile",),
    ("compile_teacher",),
    ("graphs",),
    ("optimizer", "impl"),
    ("conv_autotune",),
    ("tunableop",),
    ("inference", "runtime"),
    ("generation",),
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
    if "thin" in df and "n" in df and "min_iters" in df:  # rows stored before `thin`: fewer calls than asked
        older = df["thin"].isna() & df["n"].notna() & df["min_iters"].notna()
        df["thin"] = df["thin"].astype(object)
        df.loc[older, "thin"] = (df.loc[older, "n"] < df.loc[older, "min_iters"]).to_numpy()
    ok = df["status"].eq(Status.OK)
    _speedups(df, ok)
    _speculative(df, ok)
    _scaling(df)
    _utilisation(df, ok)
    _bandwidth(df, ok)
    _cache_payback(df)
    _break_even(df)
    return df


def speedups(rows: list[dict]) -> dict[tuple[str, int], float]:
    """The student's speed-up over its teacher per (student measurement, batch size), among one job's stamped
    rows."""
    columns = ["run_id", "cell_id", "repeat", "batch_size", "measurement", "status", "median_ms"]
    df = pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=columns)
    df["median_ms"] = pd.to_numeric(df["median_ms"], errors="coerce")
    df["speedup_vs_teacher"] = np.nan
    _speedups(df, df["status"].eq(Status.OK))
    found = df[df["speedup_vs_teacher"].notna()]
    keys = zip(found["measurement"].astype(str), found["batch_size"].astype(int))
    return dict(zip(keys, found["speedup_vs_teacher"].astype(float)))


def _speedups(df: pd.DataFrame, ok: pd.Series) -> None:
    """Each student serving row's speed-up over the same repeat's teacher row of the same kind (inference,
    prefill or decode) and batch size."""
    key = ["run_id", "cell_id", "_repeat", "batch_size"]  # a repeat's student against the same repeat's teacher
    repeat = df["repeat"].fillna(1) if "repeat" in df else pd.Series(1, index=df.index)
    inference = df[ok & df["median_ms"].gt(0)].assign(_repeat=repeat)
    for student in (m for m in SERVING if role_of(m) == "student"):
        teacher = inference[inference["measurement"].eq(counterpart(student))]
        teacher = teacher.drop_duplicates(key, keep="last").set_index(key)["median_ms"]
        students = inference[inference["measurement"].eq(student)]
        if students.empty or teacher.empty:
            continue
        t = teacher.reindex(pd.MultiIndex.from_frame(students[key])).to_numpy(dtype=float)
        df.loc[students.index, "speedup_vs_teacher"] = t / students["median_ms"].to_numpy(dtype=float)


def _speculative(df: pd.DataFrame, ok: pd.Series) -> None:
    """Each ok speculative_decode row against the batch-size-1 teacher_decode and student_decode rows of its run,
    cell and repeat (the teacher decoding alone, the draft's cost), both of the same decode_tokens: the measured
    speed-up, the cost ratio c, and the speed-up and tokens per verify predicted from the row's α, γ and c."""
    spec = df["measurement"].eq(Measurement.SPECULATIVE_DECODE) & ok & df["median_ms"].gt(0)
    if not spec.any():
        return
    key = ["run_id", "cell_id", "_repeat", "decode_tokens"]
    repeat = df["repeat"].fillna(1) if "repeat" in df else pd.Series(1, index=df.index)
    rows = df[ok & df["median_ms"].gt(0) & df["batch_size"].eq(1)].assign(_repeat=repeat)

    def medians(measurement: str) -> np.ndarray:
        alone = rows[rows["measurement"].eq(measurement)].drop_duplicates(key, keep="last").set_index(key)
        return alone["median_ms"].reindex(pd.MultiIndex.from_frame(specs[key])).to_numpy(dtype=float)

    specs = df[spec].assign(_repeat=repeat)
    teacher, student = medians(Measurement.TEACHER_DECODE), medians(Measurement.STUDENT_DECODE)
    cost = student / teacher
    df.loc[specs.index, "spec_speedup"] = teacher / specs["median_ms"].to_numpy(dtype=float)
    df.loc[specs.index, "spec_cost_ratio"] = cost
    alpha = pd.to_numeric(specs["spec_alpha"], errors="coerce").to_numpy(dtype=float)
    gamma = pd.to_numeric(specs["draft_tokens"], errors="coerce").to_numpy(dtype=float)
    known = ~np.isnan(alpha) & ~np.isnan(gamma)
    df.loc[specs.index, "spec_predicted_tokens_per_verify"] = [
        expected_tokens_per_verify(a, int(g)) if k else np.nan for a, g, k in zip(alpha, gamma, known)
    ]
    df.loc[specs.index, "spec_predicted_speedup"] = [
        predicted_speedup(a, int(g), c) if k and not np.isnan(c) else np.nan
        for a, g, c, k in zip(alpha, gamma, cost, known)
    ]


def match_twins(df: pd.DataFrame, targets: pd.Series, bases: pd.Series, drop) -> pd.Series:
    """For each row of ``targets`` (a mask), the index of its twin among ``bases``: the row of the same run,
    measurement, batch size and repeat whose config equals the target's but for the settings at the ``drop``
    paths.  Only ok rows that are not thin take part; a target without a twin is left out."""
    usable = df["status"].eq(Status.OK) & ~df.get("thin", pd.Series(False, index=df.index)).eq(True)
    usable &= df["config_json"].notna()
    rows = df[usable & (targets | bases)]
    if rows.empty:
        return pd.Series(dtype="int64")
    repeat = rows["repeat"].fillna(1).astype(int).astype(str) if "repeat" in rows else "1"
    keys = rows["config_json"].map(lambda j: twin_key(j, drop))
    where = rows["run_id"].astype(str) + "\0" + rows["measurement"].astype(str) + "\0"
    key = where + rows["batch_size"].astype(str) + "\0" + repeat + "\0" + keys.astype(str)
    key = key[keys.notna()]
    base = key[bases[key.index]]
    base = pd.Series(base.index, index=base.to_numpy())
    base = base[~base.index.duplicated(keep="last")]
    target = key[targets[key.index]]
    twin = base.reindex(target.to_numpy())
    found = twin.notna().to_numpy()
    return pd.Series(twin.to_numpy()[found].astype("int64"), index=target.index[found])


def _scaling(df: pd.DataFrame) -> None:
    step = df["measurement"].eq(Measurement.DISTILL_STEP)
    twin = match_twins(df, step & df["world_size"].gt(1), step & df["world_size"].eq(1), WORLD_SIZE)
    if twin.empty:
        return
    multi = df.loc[twin.index]
    single = df.loc[twin.to_numpy(), "throughput"].to_numpy(dtype=float)
    df.loc[twin.index, "scaling_efficiency"] = multi["throughput"].to_numpy(dtype=float) / (
        multi["world_size"].to_numpy(dtype=float) * single
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


def bandwidth_share(bytes_per_token, tokens_per_s, gbps):
    """The share of a bandwidth of ``gbps`` GB/s that reading ``bytes_per_token`` for each of ``tokens_per_s``
    tokens reaches: bytes_per_token × tokens_per_s / (gbps × 1e9)."""
    return bytes_per_token * tokens_per_s / (gbps * 1e9)


def _bandwidth(df: pd.DataFrame, ok: pd.Series) -> None:
    """Decode rows against the memory-bandwidth floor: their share of the probe's bandwidth, and the floor per token."""
    if "decode_bytes_per_token" not in df or "ceiling_gbps" not in df:
        return
    bytes_, gbps = df["decode_bytes_per_token"], df["ceiling_gbps"]
    rows = df[ok & bytes_.gt(0) & gbps.gt(0)]
    if rows.empty:
        return
    b = rows["decode_bytes_per_token"].to_numpy(dtype=float)
    g = rows["ceiling_gbps"].to_numpy(dtype=float)
    df.loc[rows.index, "floor_ms_per_token"] = b / (g * 1e9) * 1e3
    df.loc[rows.index, "bandwidth_share"] = bandwidth_share(b, rows["tokens_per_s"].to_numpy(dtype=float), g)


def _cache_payback(df: pd.DataFrame) -> None:
    step = df["measurement"].eq(Measurement.DISTILL_STEP)
    mode = df["teacher_mode"].fillna("live")
    live = step & mode.eq("live")
    twin = match_twins(df, step & mode.isin(["cached", "topk_cache", "offline"]), live, TEACHER_MODE)
    if "world_size" in df and "parallel" in df:  # a data-parallel offline cell: its FSDP-sharded live twin first
        ranks = step & mode.eq("offline") & df["world_size"].gt(1)
        sharded = match_twins(df, ranks, live & df["parallel"].eq("fsdp"), TEACHER_MODE + PARALLEL)
        twin = pd.concat([twin.drop(sharded.index, errors="ignore"), sharded]) if not sharded.empty else twin
    if twin.empty:
        return
    offline = df.loc[twin.index, "teacher_mode"].eq("offline").to_numpy()
    base = df.loc[twin.to_numpy()]
    ranks = base.get("world_size", pd.Series(1, index=base.index)).fillna(1).gt(1)
    parallel = base.get("parallel", pd.Series(None, index=base.index, dtype=object)).fillna("ddp").astype(str)
    said = np.where(ranks, "live " + parallel, "live")
    df.loc[twin.index[offline], "offline_twin"] = said[offline]
    cached = df.loc[twin.index]
    saving = df.loc[twin.to_numpy(), "median_ms"].to_numpy(dtype=float) - cached["median_ms"].to_numpy(dtype=float)
    df.loc[twin.index, "teacher_cache_saving_ms"] = saving
    df.loc[twin.index, "teacher_cache_payback_steps"] = [
        np.nan if (steps_ := payback_steps(one_off, s)) is None else float(steps_)
        for one_off, s in zip(cached["teacher_cache_ms"], saving)
    ]
    _offline_payback(df, cached, saving)


def payback_epochs(build_s, store_tokens, saving_ms_per_token):
    """The epochs after which an offline store's build (``build_s`` seconds for ``store_tokens`` tokens) is repaid by
    a saving of ``saving_ms_per_token``: the build's milliseconds per token over the saving's (a corpus's size
    cancels); NaN where the offline step saves nothing.  Arrays or Series alike."""
    per_token = np.asarray(saving_ms_per_token, dtype=float)
    build = np.asarray(build_s, dtype=float) * 1e3 / np.asarray(store_tokens, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(per_token > 0, build / per_token, np.nan)


def _offline_payback(df: pd.DataFrame, rows: pd.DataFrame, saving: np.ndarray) -> None:
    """Offline rows: the saving per token (a step's tokens on all its ranks), and the epochs after which it repays the
    store's build (the build's seconds per token over the saving's: a corpus's size cancels)."""
    if "teacher_store_build_s" not in rows:
        return
    offline = (rows["teacher_mode"] == "offline").to_numpy()
    if not offline.any():
        return
    idx = rows.index[offline]
    ranks = rows.loc[idx, "world_size"].fillna(1) if "world_size" in rows else 1
    tokens = (rows.loc[idx, "tokens"] * ranks).astype(float).to_numpy()
    per_token = saving[offline] / tokens
    df.loc[idx, "offline_saving_ms_per_token"] = per_token
    df.loc[idx, "offline_payback_epochs"] = payback_epochs(
        rows.loc[idx, "teacher_store_build_s"], rows.loc[idx, "teacher_store_tokens"], per_token
    )


def _break_even(df: pd.DataFrame) -> None:
    """Per cell that pulls levers with a one-off cost: the gain per call against its twin without levers,
    repeat by repeat, pooled (mean and paired t-interval), and the calls after which the net one-off cost
    (its own, minus the twin's cold-call excess) is repaid, with the range the gain's interval allows."""
    if not df["one_off_ms"].notna().any():
        return
    bare = df["config_json"].map(lambda j: twin_key(j, ()))
    keys = df["config_json"].map(lambda j: twin_key(j, LEVERS))
    plain = bare.eq(keys) & keys.notna()  # cells that pull no lever
    pulled = df["one_off_ms"].notna() & bare.ne(keys) & df["median_ms"].gt(0)
    twin = match_twins(df, pulled, plain & df["median_ms"].gt(0), LEVERS)
    if twin.empty:
        return
    rows = df.loc[twin.index]
    twins = df.loc[twin.to_numpy()]
    frame = pd.DataFrame(
        {
            "cell": (rows["run_id"].astype(str) + "\0" + rows["cell_id"].astype(str)).to_numpy(),
            "what": (rows["measurement"].astype(str) + "\0" + rows["batch_size"].astype(str)).to_numpy(),
            "baseline": twins["median_ms"].to_numpy(dtype=float),
            "gain": twins["median_ms"].to_numpy(dtype=float) - rows["median_ms"].to_numpy(dtype=float),
            "net": rows["one_off_ms"].to_numpy(dtype=float) - twins["cold_excess_ms"].fillna(0).to_numpy(dtype=float),
        },
        index=rows.index,
    )
    for _, group in frame.groupby(["cell", "what"], sort=False):
        gain, low, high = paired_t(group["gain"].tolist())
        net = max(0.0, float(group["net"].mean()))
        values = {
            "lever_baseline_ms": centre(group["baseline"].tolist()),
            "lever_gain_ms": gain,
            "lever_gain_low_ms": low,
            "lever_gain_high_ms": high,
            "lever_one_off_net_ms": net,
            "break_even_steps": payback_steps(net, gain),
            # the fewest calls: at the largest gain the interval allows; the most: at its smallest (none: never)
            "break_even_low_steps": payback_steps(net, high) if high is not None else None,
            "break_even_high_steps": payback_steps(net, low) if low is not None else None,
        }
        for column, value in values.items():
            df.loc[group.index, column] = np.nan if value is None else float(value)
    # decode rows: the break-even in generated tokens, the calls times the tokens each call generates
    decode = rows.index[rows["measurement"].isin(DECODE).to_numpy()]
    if len(decode):
        df.loc[decode, "break_even_tokens"] = df.loc[decode, "break_even_steps"] * df.loc[decode, "tokens"].astype(
            float
        )
