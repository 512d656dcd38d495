"""How the report writes a figure in a table cell: times and any quantity to 3 significant digits, counts with
thousands separators, ratios as percentages or speed-ups, bytes in MiB, "mean ± std", and :data:`MISSING` for a
value that is not there.

The lowest module of the report package (pandas only): the page (:mod:`kdbench.report.html`), its sections and
the quality table all write numbers through it, so one figure reads the same everywhere.
"""

from __future__ import annotations

import math

import pandas as pd

MISSING = "—"
ERROR_CHARS = 200  # an error message is cut to this length in a table cell
MIB = 2**20


def format_ms(x) -> str:
    """A time to 3 significant digits in plain notation: 1234.5 → '1230', 0.012345 → '0.0123'."""
    if pd.isna(x):
        return MISSING
    x = float(f"{float(x):.3g}")
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def format_int(x) -> str:
    """A count or throughput as a rounded integer with thousands separators."""
    return MISSING if pd.isna(x) else f"{float(x):,.0f}"


def format_speedup(x) -> str:
    return MISSING if pd.isna(x) else f"{float(x):.2f}×"


def format_sig(x, unit: str = "") -> str:
    """Any quantity to 3 significant digits (as :func:`format_ms`), with ``unit`` appended."""
    if pd.isna(x):
        return MISSING
    return format_ms(x) + (f" {unit}" if unit else "")


def format_percent(ratio) -> str:
    """A ratio as a percentage to 3 significant digits: 0.1234 → '12.3 %'."""
    return format_sig(None if pd.isna(ratio) else float(ratio) * 100, "%")


def format_mib(n_bytes) -> str:
    return MISSING if pd.isna(n_bytes) else f"{float(n_bytes) / MIB:,.1f} MiB"


def mean_std(mean, std, scale: float = 1.0, fmt=lambda v: f"{v:.1f}", missing: str = MISSING) -> str:
    """ "mean ± std" (scaled); the mean alone when std is undefined (one seed); ``missing`` without a mean."""
    if mean is None or pd.isna(mean) or not math.isfinite(float(mean)):
        return missing
    text = fmt(float(mean) * scale)
    return text if std is None or pd.isna(std) else f"{text} ± {fmt(float(std) * scale)}"


def text(x) -> str:
    """A value as it is, :data:`MISSING` when null."""
    return MISSING if pd.isna(x) else str(x)


def truncate(message, limit: int = ERROR_CHARS) -> str:
    """A message cut to ``limit`` characters (its last one an ellipsis); empty when null."""
    if pd.isna(message):
        return ""
    return message if len(message) <= limit else message[: limit - 1] + "…"


def timestamp(ts) -> str:
    return MISSING if pd.isna(ts) else ts.strftime("%Y-%m-%d %H:%M:%S UTC")


def values(series: pd.Series) -> str:
    """The distinct non-null values of ``series``, comma-separated (empty when none)."""
    return ", ".join(map(str, series.dropna().unique()))
