"""`kdbench probe` files: a device's measured ceilings, kept apart from results.

A probe is one parquet file ``<results>/probes/<probe id>.parquet``: one row per
ceiling (``kind`` matmul per dtype, copy, or one of the classes the step-time model prices apart:
:mod:`kdbench.measure.probe_classes`) with the environment of the machine
that measured it.  A run looks up the newest probe of its device and backend when it
starts and stores the ceiling beside each row (``ceiling_tflops``, ``ceiling_gbps``,
``ceiling_probe_id``).
"""

from __future__ import annotations

import math
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kdbench.store.files import write_parquet

PROBE_SCHEMA = pa.schema(
    [
        ("probe_id", pa.string()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("kind", pa.string()),
        ("dtype", pa.string()),
        ("size", pa.int64()),
        ("value", pa.float64()),
        ("unit", pa.string()),
        ("median_ms", pa.float64()),
        ("p05_ms", pa.float64()),
        ("error", pa.string()),
    ]
)


def write_probe(rows: list[dict], env: dict[str, Any], out_dir: Path) -> Path:
    """Write the ceilings ``rows`` (see :func:`kdbench.measure.probe.measure_ceilings`), each with every
    ``env`` column, atomically to ``out_dir/<probe_id>.parquet``.  Give ``env`` a ``backend``
    column for :func:`latest_ceiling` to find it."""
    clash = set(env) & set(PROBE_SCHEMA.names)
    if clash:
        raise ValueError(f"env keys clash with probe columns: {sorted(clash)}")
    now = datetime.now(UTC)
    probe_id = f"probe-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    fixed = {name: [r.get(name) for r in rows] for name in PROBE_SCHEMA.names[2:]}
    table = pa.Table.from_pydict(
        {"probe_id": [probe_id] * len(rows), "timestamp": [now] * len(rows), **fixed}, schema=PROBE_SCHEMA
    )
    for key, value in env.items():
        table = table.append_column(key, pa.array([value] * len(rows)))
    return write_parquet(table, Path(out_dir) / f"{probe_id}.parquet")


def latest_ceiling(out_dir: Path, device_name: str, backend_name: str) -> dict[str, Any] | None:
    """From the newest probe in ``out_dir`` for this device and backend: ``{"matmul_<dtype>":
    TFLOP/s, "copy": GB/s, "<kind>_<dtype>": the class rates, "probe_id": ...}`` (:func:`ceiling_key`; failed
    measurements left out); None if none."""
    matches: list[dict] = []
    try:
        files = sorted(Path(out_dir).glob("probe-*.parquet"))
    except OSError:
        return None
    for path in files:
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception:  # unreadable or foreign file: not a probe we can use
            continue
        matches += [r for r in rows if r.get("device_name") == device_name and r.get("backend") == backend_name]
    if not matches:
        return None
    newest = max(matches, key=lambda r: (r["timestamp"], r["probe_id"]))["probe_id"]
    out: dict[str, Any] = {"probe_id": newest}
    for r in matches:
        value = r.get("value")
        if r["probe_id"] != newest or value is None or not math.isfinite(value):
            continue
        out[ceiling_key(r["kind"], r["dtype"])] = value
    return out


def ceiling_key(kind: str, dtype: str) -> str:
    """A probe row's key in :func:`latest_ceiling`'s dict: ``copy``, ``matmul_<dtype>``, or ``<kind>_<dtype>`` for
    the per-class rows (:mod:`kdbench.measure.probe_classes`: ``exp_fp32``, ``launch_conv``, ...)."""
    return "copy" if kind == "copy" else f"{kind}_{dtype}"


def ceiling_columns(ceiling: dict[str, Any] | None, precision: str | None, teacher_precision: str | None = None):
    """The probe's matmul ceilings at the student's and the teacher's precision and its copy bandwidth, as row
    columns."""
    if not ceiling:
        return {}
    values = {
        "ceiling_tflops": ceiling.get(f"matmul_{precision}"),
        "teacher_ceiling_tflops": ceiling.get(f"matmul_{teacher_precision}"),
        "ceiling_gbps": ceiling.get("copy"),
    }
    found = {k: v for k, v in values.items() if v}
    return {**found, "ceiling_probe_id": ceiling["probe_id"]} if found else {}
