"""Verdicts: a NEW run against a BASE run, measurement by measurement, with a confidence interval.

Cells are matched by ``cell_id`` (a hash of the resolved cell config, not of the
machine), so the same suite run on two machines, two drivers or two commits compares
cell by cell.  Each timed measurement (key: cell, measurement, batch size) yields a
:class:`Change`: the ratio NEW/BASE of the medians, and a confidence interval of that
ratio from a bootstrap of the raw samples (:func:`ratio_interval`).

* With one repeat per side, the bootstrap resamples the iterations: the interval shows
  the noise *within* one process, which understates the noise from run to run
  (a note says so).
* With repeats (``repeat: N``, each in a fresh worker process), the centre of a side is
  the median of its repeats' medians, and the bootstrap resamples the repeats as well
  as the iterations inside each (a two-level, "cluster" bootstrap): the interval holds
  the variation *between* processes.

The intervals are *simultaneous*: ``confidence`` (0.95) holds for all the measurements of
a comparison together, each interval being at 1 − (1 − confidence)/m for m measurements
(Bonferroni).  A gate asks one question — "is anything slower?" — of every measurement,
and twenty 95 % intervals would exclude 1 somewhere in about two comparisons of three
where nothing changed.

A measurement *regressed* when the interval lies wholly above 1 **and** the ratio
exceeds 1 + threshold; it *improved* when the interval lies wholly below 1 and the ratio
is under 1 − threshold; otherwise it is unchanged.  A measurement that is ok in BASE
but failed in NEW counts as a regression too.  Torch-free: it reads DataFrames only.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import numpy as np
import pandas as pd

from kdbench.errors import KdbenchError
from kdbench.names import Measurement, Status

TIMED = (Measurement.DISTILL_STEP, Measurement.STUDENT_INFERENCE, Measurement.TEACHER_INFERENCE)
KEY = ("cell_id", "measurement", "batch_size")
N_BOOT = 5000  # bootstrap draws at least; more when simultaneous intervals reach far into the tails
MAX_BOOT = 100_000
FORMATS = ("text", "markdown", "json", "csv")


class Verdict(StrEnum):
    REGRESSED = "regressed"  # significantly slower, beyond the threshold
    FAILED = "failed"  # ok in BASE, failed (or oom, timeout) in NEW
    IMPROVED = "improved"  # significantly faster, beyond the threshold
    FIXED = "fixed"  # failed in BASE, ok in NEW
    UNCHANGED = "unchanged"  # within noise or within the threshold
    BOTH_FAILED = "both failed"
    ONLY_BASE = "only in base"
    ONLY_NEW = "only in new"


BAD = (Verdict.REGRESSED, Verdict.FAILED)  # verdicts that make `compare` exit 1
_ORDER = {v: i for i, v in enumerate(Verdict)}


@dataclass(frozen=True)
class Change:
    cell_id: str
    cell_label: str
    measurement: str
    batch_size: int | None
    verdict: Verdict
    base_median_ms: float | None = None
    new_median_ms: float | None = None
    ratio: float | None = None  # NEW / BASE of the centres (medians; medians of repeat medians)
    ci_low: float | None = None
    ci_high: float | None = None
    base_repeats: int = 0  # ok repeats on each side
    new_repeats: int = 0
    note: str = ""

    @property
    def name(self) -> str:
        bs = f" bs{self.batch_size}" if self.batch_size is not None else ""
        return f"{self.cell_label} · {self.measurement}{bs}"


@dataclass(frozen=True)
class Side:
    """One side of a comparison: which run and machine it is."""

    label: str  # the path as given
    run_ids: tuple[str, ...]
    devices: tuple[str, ...]
    repeats: int  # the most repeats of any measurement


@dataclass
class Comparison:
    base: Side
    new: Side
    threshold: float
    confidence: float  # for all the measurements together
    changes: list[Change] = field(default_factory=list)

    @property
    def rated(self) -> int:
        """Measurements with a ratio (ok on both sides): the m of the simultaneous intervals."""
        return sum(c.ratio is not None for c in self.changes)

    @property
    def each(self) -> float:
        """The confidence of each interval: 1 - (1 - confidence) / m."""
        return 1 - (1 - self.confidence) / max(1, self.rated)

    @property
    def bad(self) -> list[Change]:
        return [c for c in self.changes if c.verdict in BAD]

    @property
    def exit_code(self) -> int:
        return 1 if self.bad else 0

    def notes(self) -> list[str]:
        notes = []
        if self.base.repeats <= 1 or self.new.repeats <= 1:
            notes.append(
                "one side has a single repeat: its interval shows the noise within one process, which understates "
                "run-to-run noise; run with `repeat: 3` (or --repeat 3) for verdicts you can gate on"
            )
        if set(self.base.devices) != set(self.new.devices):
            notes.append(f"different devices: {', '.join(self.base.devices)} vs {', '.join(self.new.devices)}")
        return notes


# --------------------------------------------------------------------------- statistics


def _median_draws(x: np.ndarray, size: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Draws of the median of a bootstrap resample of ``x`` (n values, with replacement), without
    building the resamples.

    The k-th smallest of n draws from the empirical distribution is ``sorted(x)[ceil(n U) - 1]``
    with U the k-th smallest of n uniforms, which is Beta(k, n + 1 - k); for even n the next
    order statistic is U + (1 - U) Beta(1, n - k).  So each draw costs O(1), not O(n).
    """
    s = np.sort(x)
    n = s.size
    if n == 1:
        return np.full(size, s[0])

    def at(u: np.ndarray) -> np.ndarray:
        return s[np.clip(np.ceil(u * n).astype(np.int64) - 1, 0, n - 1)]

    k = (n + 1) // 2
    u = rng.beta(k, n + 1 - k, size)
    if n % 2:
        return at(u)
    v = u + (1 - u) * rng.beta(1, n - k, size)
    return (at(u) + at(v)) / 2


def centre(groups: list[np.ndarray]) -> float:
    """The centre of one side: the median of its repeats' medians (the median, with one repeat)."""
    return float(np.median([np.median(g) for g in groups]))


def bootstrap_centres(groups: list[np.ndarray], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` bootstrap draws of :func:`centre`: the repeats resampled with replacement, and each
    chosen repeat's iterations resampled too (each draw independent)."""
    r = len(groups)
    draws = np.stack([_median_draws(g, (n_boot, r), rng) for g in groups])  # (repeat, draw, slot)
    if r == 1:
        return draws[0, :, 0]
    pick = rng.integers(0, r, size=(n_boot, r))
    chosen = draws[pick, np.arange(n_boot)[:, None], np.arange(r)[None, :]]
    return np.median(chosen, axis=1)


def ratio_interval(
    base: list[np.ndarray], new: list[np.ndarray], confidence: float = 0.95, n_boot: int = N_BOOT, seed: int = 0
) -> tuple[float, float, float]:
    """NEW/BASE of the centres and its percentile-bootstrap interval at ``confidence``."""
    rng = np.random.default_rng(seed)
    ratio = centre(new) / centre(base)
    boot = bootstrap_centres(new, n_boot, rng) / bootstrap_centres(base, n_boot, rng)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(boot, [alpha, 1 - alpha])
    return ratio, float(low), float(high)


def verdict_of(ratio: float, low: float, high: float, threshold: float) -> Verdict:
    if low > 1 and ratio > 1 + threshold:
        return Verdict.REGRESSED
    if high < 1 and ratio < 1 - threshold:
        return Verdict.IMPROVED
    return Verdict.UNCHANGED


# --------------------------------------------------------------------------- matching


def _seed(key: tuple) -> int:
    """A seed per measurement: the same inputs give the same interval, in any order."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")


def _timed(df: pd.DataFrame, label: str) -> pd.DataFrame:
    if df.empty or "measurement" not in df:
        raise KdbenchError(f"{label}: holds no result rows; give a run folder or result file of `kdbench run`")
    rows = df[df["measurement"].isin(list(TIMED))].copy()
    if rows.empty:
        raise KdbenchError(f"{label}: holds no timed measurements (distill_step or inference rows) to compare")
    runs = sorted(rows["run_id"].dropna().unique())
    if len(runs) > 1:
        shown = ", ".join(runs[:4]) + (" ..." if len(runs) > 4 else "")
        raise KdbenchError(f"{label}: holds {len(runs)} runs ({shown}); give one run folder on each side")
    rows["batch_size"] = rows["batch_size"].astype("Int64")
    rows["repeat"] = rows["repeat"].fillna(1).astype(int) if "repeat" in rows else 1
    return rows


def _side(rows: pd.DataFrame, label: str) -> Side:
    devices = tuple(dict.fromkeys(rows["device_name"].dropna().astype(str))) if "device_name" in rows else ()
    ok = rows[rows["status"].eq(Status.OK)]
    repeats = int(ok.groupby(list(KEY), dropna=False).size().max()) if not ok.empty else 0
    return Side(label, tuple(sorted(rows["run_id"].dropna().unique())), devices, repeats)


def _samples(rows: pd.DataFrame) -> list[np.ndarray]:
    """The ok repeats' raw samples (a row without samples contributes its median alone)."""
    groups = []
    for samples, median in zip(rows["samples_ms"], rows["median_ms"]):
        a = np.asarray(samples if samples is not None else [], dtype=float)
        a = a[np.isfinite(a)]
        if a.size == 0 and pd.notna(median):
            a = np.array([float(median)])
        if a.size:
            groups.append(a)
    return groups


def compare_frames(
    base: pd.DataFrame,
    new: pd.DataFrame,
    threshold: float = 0.05,
    confidence: float = 0.95,
    base_label: str = "BASE",
    new_label: str = "NEW",
) -> Comparison:
    """NEW against BASE, every timed measurement of either side (see the module docstring)."""
    if not 0 <= threshold < 1:
        raise KdbenchError(f"--threshold: must be a percentage from 0 to 100 (exclusive), got {threshold * 100:g}")
    if not 0.5 <= confidence < 1:
        raise KdbenchError(f"--confidence: must be from 0.5 to 1 (exclusive), e.g. 0.95; got {confidence:g}")
    b, n = _timed(base, base_label), _timed(new, new_label)
    if not set(b["cell_id"]) & set(n["cell_id"]):
        raise KdbenchError(
            f"{base_label} and {new_label} have no cell in common (cells match by cell_id, the hash of the "
            "resolved cell config): compare runs of the same suite"
        )
    result = Comparison(_side(b, base_label), _side(n, new_label), threshold, confidence)
    groups_b = dict(iter(b.groupby(list(KEY), dropna=False, sort=False)))
    groups_n = dict(iter(n.groupby(list(KEY), dropna=False, sort=False)))
    keys = list(dict.fromkeys([*groups_b, *groups_n]))
    ok = {key: (_ok(groups_b.get(key)), _ok(groups_n.get(key))) for key in keys}
    m = sum(bool(gb) and bool(gn) for gb, gn in ok.values())
    each = 1 - (1 - confidence) / max(1, m)  # simultaneous over the m measurements with a ratio
    for key in keys:
        result.changes.append(_change(key, groups_b.get(key), groups_n.get(key), *ok[key], threshold, each))
    result.changes.sort(key=_rank)
    return result


def _rank(c: Change) -> tuple:
    worst = -(c.ratio or 0) if c.verdict in (Verdict.REGRESSED, Verdict.UNCHANGED) else (c.ratio or 0)
    return (_ORDER[c.verdict], worst, c.cell_label, c.measurement, c.batch_size or 0)


def _ok(rows: pd.DataFrame | None) -> list[np.ndarray]:
    return [] if rows is None else _samples(rows[rows["status"].eq(Status.OK)])


def _change(
    key: tuple,
    b: pd.DataFrame | None,
    n: pd.DataFrame | None,
    gb: list[np.ndarray],
    gn: list[np.ndarray],
    threshold: float,
    confidence: float,
) -> Change:
    cell_id, measurement, bs = key
    label = str((n if n is not None else b)["cell_label"].iloc[-1])
    common = dict(cell_id=cell_id, cell_label=label, measurement=str(measurement), batch_size=_int(bs))
    if b is None or n is None:
        return Change(**common, verdict=Verdict.ONLY_NEW if b is None else Verdict.ONLY_BASE)
    counts = dict(base_repeats=len(gb), new_repeats=len(gn))
    if not gb or not gn:
        why = _error(n if not gn else b)
        verdict = Verdict.BOTH_FAILED if not gb and not gn else Verdict.FAILED if not gn else Verdict.FIXED
        medians = dict(base_median_ms=centre(gb) if gb else None, new_median_ms=centre(gn) if gn else None)
        return Change(**common, verdict=verdict, **medians, **counts, note=why)
    tail = (1 - confidence) / 2
    n_boot = min(MAX_BOOT, max(N_BOOT, math.ceil(20 / tail)))  # some 20 draws beyond each end of the interval
    ratio, low, high = ratio_interval(gb, gn, confidence, n_boot=n_boot, seed=_seed(key))
    lost = [
        f"{side}: {len(rows) - len(g)} of {len(rows)} repeats failed"
        for side, rows, g in (("base", b, gb), ("new", n, gn))
        if len(g) < len(rows)
    ]
    return Change(
        **common,
        verdict=verdict_of(ratio, low, high, threshold),
        base_median_ms=centre(gb),
        new_median_ms=centre(gn),
        ratio=ratio,
        ci_low=low,
        ci_high=high,
        **counts,
        note="; ".join(lost),
    )


def _int(v) -> int | None:
    return None if v is None or pd.isna(v) else int(v)


def _error(rows: pd.DataFrame) -> str:
    bad = rows[~rows["status"].eq(Status.OK)]
    if bad.empty:
        return ""
    r = bad.iloc[-1]
    return f"{r['status']}: {' '.join(str(r.get('error') or '').split())[:160]}"


# --------------------------------------------------------------------------- output


def _ms(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def _ratio(c: Change) -> str:
    if c.ratio is None:
        return "—"
    return f"{c.ratio:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}]"


def records(cmp: Comparison) -> list[dict]:
    return [{**asdict(c), "verdict": str(c.verdict)} for c in cmp.changes]


def _header(cmp: Comparison) -> list[str]:
    def side(s: Side) -> str:
        return f"{s.label} (run {', '.join(s.run_ids)}; {', '.join(s.devices) or '?'}; {s.repeats} repeat(s))"

    counts = {v: sum(c.verdict == v for c in cmp.changes) for v in Verdict}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    return [
        f"BASE {side(cmp.base)}",
        f"NEW  {side(cmp.new)}",
        f"ratio NEW/BASE of medians with {cmp.confidence:.0%} simultaneous intervals ({cmp.rated} measurements, "
        f"each at {cmp.each:.4g}); significant when the interval excludes 1 and the ratio is beyond "
        f"±{cmp.threshold:.0%}: {summary}",
        *(f"note: {n}" for n in cmp.notes()),
    ]


def format_text(cmp: Comparison) -> str:
    lines = _header(cmp)
    for verdict in Verdict:
        changes = [c for c in cmp.changes if c.verdict == verdict]
        if not changes or verdict == Verdict.UNCHANGED:
            continue
        lines.append(f"\n{str(verdict).upper()} ({len(changes)}){', worst first' if verdict in BAD else ''}:")
        for c in changes:
            times = f"{_ms(c.base_median_ms)} -> {_ms(c.new_median_ms)} ms" if c.ratio is not None else ""
            extra = "  ".join(x for x in (times, _ratio(c) if c.ratio is not None else "", c.note) if x)
            lines.append(f"  {c.name}  {extra}".rstrip())
    unchanged = sum(c.verdict == Verdict.UNCHANGED for c in cmp.changes)
    lines.append(f"\n{unchanged} measurement(s) unchanged")
    lines.append("verdict: " + (f"{len(cmp.bad)} regression(s)" if cmp.bad else "no significant regression"))
    return "\n".join(lines) + "\n"


def format_markdown(cmp: Comparison) -> str:
    lines = [f"- {h}" for h in _header(cmp)]
    lines += [
        "",
        "| verdict | cell | measurement | batch | base median (ms) | new median (ms) | ratio [interval] | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cmp.changes:
        cells = [str(c.verdict), c.cell_label, c.measurement, "" if c.batch_size is None else str(c.batch_size)]
        cells += [_ms(c.base_median_ms), _ms(c.new_median_ms), _ratio(c), c.note]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    return "\n".join(lines) + "\n"


def format_json(cmp: Comparison) -> str:
    doc = {
        "base": asdict(cmp.base),
        "new": asdict(cmp.new),
        "threshold": cmp.threshold,
        "confidence": cmp.confidence,
        "confidence_each": cmp.each,
        "regressions": len(cmp.bad),
        "exit_code": cmp.exit_code,
        "notes": cmp.notes(),
        "changes": records(cmp),
    }
    return json.dumps(doc, indent=2) + "\n"


def format_csv(cmp: Comparison) -> str:
    columns = [f.name for f in Change.__dataclass_fields__.values()]
    return pd.DataFrame(records(cmp), columns=columns).to_csv(index=False)


def render(cmp: Comparison, fmt: str) -> str:
    formats = {"text": format_text, "markdown": format_markdown, "json": format_json, "csv": format_csv}
    if fmt not in formats:
        raise KdbenchError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    return formats[fmt](cmp)


def side_by_side(
    df: pd.DataFrame, base: pd.DataFrame | None = None, threshold: float = 0.05, confidence: float = 0.95
) -> list[Comparison]:
    """The report's comparisons: every run of ``df`` against ``base`` (one run), or, without a base, every
    run after the first (by its first measurement) against the first, e.g. the same suite on two machines.
    Runs with no timed cell in common with the base are left out (a given base must share cells with one)."""
    if df.empty or "run_id" not in df:
        return []
    order = df.groupby("run_id")["timestamp"].min().sort_values(kind="stable").index.tolist()
    given = base is not None
    if base is None:
        if len(order) < 2:
            return []
        base = df[df["run_id"].eq(order[0])]
    else:
        _timed(base, "--baseline")  # one run, with timed rows: else the user's mistake
    base_ids = set(base["run_id"].dropna())
    base_label = ", ".join(sorted(base_ids))
    out = []
    for run_id in order:
        if run_id in base_ids:
            continue
        try:
            new = df[df["run_id"].eq(run_id)]
            out.append(compare_frames(base, new, threshold, confidence, base_label, str(run_id)))
        except KdbenchError:  # a run of other cells, or of quality rows only: nothing to compare
            continue
    if given and not out:
        raise KdbenchError(f"--baseline {base_label}: no other run of the results has a timed cell in common with it")
    return out
