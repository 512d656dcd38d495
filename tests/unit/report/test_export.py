"""Tests of `kdbench export`: csv and json round trips, and pytest-benchmark files read by pytest-benchmark itself."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kdbench.core.errors import KdbenchError
from kdbench.core.schema import COLUMN_NAMES, Row
from kdbench.report.export import FORMATS, _stats, export, write_export
from tests.support.helpers import as_read
from tests.support.rows import result_row

HOST = {
    "hostname": "gpu-a",
    "device_name": "NVIDIA H200",
    "device_arch": "sm_90",
    "backend": "cuda",
    "torch_version": "2.5.1",
    "cuda_version": "12.4",
    "cpu_model": "AMD EPYC 9454",
    "cpu_count": 96,
    "os": "Linux-5.15.0-1052-azure-x86_64-with-glibc2.35",
    "python_version": "3.11.9",
    "git_commit": "0123456789abcdef0123456789abcdef01234567",
}
SAMPLES = {  # (measurement, batch size): samples_ms; counts of every quartile case of pytest-benchmark
    ("distill_step", 64): [41.5, 40.25, 40.0, 44.125, 40.5, 39.875, 60.0],  # 7: odd, n % 4 == 3
    ("student_inference", 1): [1.23456, 1.2, 1.3, 1.25, 1.21, 1.22, 1.24, 1.9],  # 8: even
    ("student_inference", 64): [5.0, 5.5, 4.75, 5.25, 5.125],  # 5: n % 4 == 1
    ("teacher_inference", 1): [3.5],  # 1
}
LABEL = "resnet50->resnet18 kd fp16 bs64"


EXPORTED = {  # what every row of this file shares
    "schema_version": 2,
    "run_id": "run-a",
    "suite": "smoke",
    "cell_id": "c0ffee1234567890",
    "cell_label": LABEL,
    "precision": "fp16",
    "teacher": "resnet50",
    "student": "resnet18",
    "method": "kd",
    "world_size": 1,
    "timer": "device_event",
    "min_iters": 5,
    "warmup": 2,
    "timestamp": datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
    "noisy": False,
    **HOST,
}


def _row(measurement: str, batch_size: int, samples: list[float] | None, **extra) -> Row:
    """A row of this file's cell, its statistics from ``samples`` (None: not measured)."""
    s = np.asarray(samples if samples else [np.nan])
    statistics = {
        "n": len(samples) if samples else None,
        "median_ms": float(np.median(s)) if samples else None,
        "min_ms": float(s.min()) if samples else None,
        "samples_ms": samples,
    }
    return result_row(**EXPORTED, measurement=measurement, batch_size=batch_size) | statistics | extra


def _rows() -> list[dict]:
    rows = [_row(m, bs, samples) for (m, bs), samples in SAMPLES.items()]
    rows.append(_row("teacher_inference", 64, None, status="failed", error="RuntimeError: boom"))
    rows.append(_row("quality", None, None, cell_id="quality-abc", cell_label="quality (digits, 1 seed)", accuracy=0.9))
    return rows


def _frame(rows=None) -> pd.DataFrame:
    return as_read(rows if rows is not None else _rows())


def test_csv_round_trip():
    df = _frame()
    back = pd.read_csv(io.StringIO(export(df, "csv")))
    assert list(back.columns) == [c for c in COLUMN_NAMES if c in df.columns] and len(back) == len(df)
    assert list(back["cell_id"]) == list(df["cell_id"])
    assert back["median_ms"].equals(df["median_ms"])  # exact floats, NaN where null
    assert back["median_ms"][1] == np.median(SAMPLES["student_inference", 1])
    assert back["batch_size"].dropna().tolist() == [64, 1, 64, 1, 64]
    assert [json.loads(s) if isinstance(s, str) else None for s in back["samples_ms"]] == [
        *SAMPLES.values(),
        None,
        None,
    ]
    assert (pd.to_datetime(back["timestamp"]) == df["timestamp"]).all()
    assert back["timestamp"][0] == "2025-01-02T03:04:05.678901+00:00"


def test_json_round_trip():
    df = _frame()
    back = json.loads(export(df, "json"))
    assert [list(r) for r in back] == [[c for c in COLUMN_NAMES if c in df.columns]] * len(df)
    assert [r["cell_id"] for r in back] == list(df["cell_id"])
    assert [r["median_ms"] for r in back] == [float(np.median(v)) for v in SAMPLES.values()] + [None, None]
    assert [r["samples_ms"] for r in back] == [*SAMPLES.values(), None, None]
    assert back[0]["batch_size"] == 64 and isinstance(back[0]["batch_size"], int) and back[5]["batch_size"] is None
    assert back[0]["timestamp"] == "2025-01-02T03:04:05.678901+00:00"
    assert back[5]["accuracy"] == 0.9 and back[0]["accuracy"] is None


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 51])
def test_stats_as_pytest_benchmark_computes_them(n):
    from pytest_benchmark.stats import Stats

    data = list(np.random.default_rng(n).lognormal(-3, 0.5, n))
    data[n // 2] *= 5  # an outlier
    ref = Stats()
    for v in data:
        ref.update(float(v))
    assert _stats([float(v) for v in data]) == {**ref.as_dict(), "data": ref.data, "iterations": 1}


# Data sets for the field-by-field comparison with pytest_benchmark.stats.Stats: every count of rounds that
# changes its quartile method, outliers on one side and on both, ties, and data exactly on a Tukey fence.
STATS_DATA = {
    "n1": [0.5],
    "n2": [1.0, 3.0],
    "n3 outlier above": [1.0, 2.0, 100.0],
    "n4 outlier above": [1.0, 2.0, 3.0, 50.0],
    "n5 both sides": [1.2, 1.1, 0.001, 9.0, 1.0],
    "n7 both sides": [10.0, 10.5, 11.0, 10.25, 0.5, 10.75, 40.0],
    "n10 both sides": [5.0, 5.1, 5.2, 5.3, 5.4, 5.5, 5.6, 5.7, 0.1, 90.0],
    "all tied": [2.0, 2.0, 2.0, 2.0, 2.0],
    "ties at the ends": [1.0, 1.0, 1.0, 5.0, 5.0, 5.0],
    "ties beyond the fences": [0.0, 0.0, 12.0, 12.0, 12.0, 14.0, 14.0, 14.0, 30.0, 30.0],
    "on both fences": [17.0, 12.0, 9.0, 12.0, 14.0, 12.0, 14.0, 14.0],  # q1 12, q3 14: fences 9 and 17
    "just beyond both fences": [17.0 + 2**-40, 12.0, 9.0 - 2**-40, 12.0, 14.0, 12.0, 14.0, 14.0],
    "on the upper fence, odd": [1.0, 11.0, 2.0, 1.0, 3.0],  # method 3: q1 1, q3 5, upper fence 11
    "just beyond the upper fence, odd": [1.0, 11.0 + 2**-40, 2.0, 1.0, 3.0],
}


@pytest.mark.parametrize("name", list(STATS_DATA))
def test_every_stats_field_as_pytest_benchmark_computes_it(name):
    from pytest_benchmark.stats import Stats

    data = STATS_DATA[name]
    ref = Stats()
    for v in data:
        ref.update(v)
    ours = _stats(list(data))
    assert set(Stats.fields) <= set(ours)
    for field in Stats.fields:
        assert ours[field] == getattr(ref, field), (field, ours[field], getattr(ref, field))
    assert (ours["data"], ours["iterations"]) == (data, 1)


def test_the_tukey_data_are_the_extremes_within_the_fences():
    """ld15iqr / hd15iqr: the lowest and highest data within Q1 - 1.5 IQR and Q3 + 1.5 IQR, fences included."""
    both = _stats(STATS_DATA["n10 both sides"])  # q1 5.1, q3 5.6: fences 4.35 and 6.35
    assert (both["ld15iqr"], both["hd15iqr"], both["iqr_outliers"]) == (5.0, 5.7, 2)
    fences = _stats(STATS_DATA["on both fences"])
    assert (fences["q1"], fences["q3"], fences["iqr"]) == (12.0, 14.0, 2.0)
    assert (fences["ld15iqr"], fences["hd15iqr"], fences["iqr_outliers"]) == (9.0, 17.0, 0)  # on a fence: within
    beyond = _stats(STATS_DATA["just beyond both fences"])
    assert (beyond["ld15iqr"], beyond["hd15iqr"], beyond["iqr_outliers"]) == (12.0, 14.0, 2)
    ties = _stats(STATS_DATA["ties beyond the fences"])  # q1 12, q3 14: fences 9 and 17
    assert (ties["ld15iqr"], ties["hd15iqr"], ties["iqr_outliers"]) == (12.0, 14.0, 4)
    assert _stats([0.5])["ld15iqr"] == _stats([0.5])["hd15iqr"] == 0.5
    tied = _stats(STATS_DATA["all tied"])
    assert (tied["iqr"], tied["ld15iqr"], tied["hd15iqr"], tied["iqr_outliers"]) == (0.0, 2.0, 2.0, 0)
    odd = _stats(STATS_DATA["on the upper fence, odd"])
    assert (odd["q1"], odd["q3"], odd["hd15iqr"], odd["iqr_outliers"]) == (1.0, 5.0, 11.0, 0)
    odd_beyond = _stats(STATS_DATA["just beyond the upper fence, odd"])
    assert (odd_beyond["hd15iqr"], odd_beyond["iqr_outliers"]) == (3.0, 1)
    assert _stats(STATS_DATA["n3 outlier above"])["hd15iqr"] == 100.0  # q1 1.25, q3 75.5: within the fence


def _load_with_pytest_benchmark(path: Path) -> list[dict]:
    """The benchmarks of ``path`` as `pytest-benchmark compare` loads them (FileStorage.load_benchmarks)."""
    from pytest_benchmark.logger import Logger
    from pytest_benchmark.storage.file import FileStorage

    storage = FileStorage(path.parent / "storage", logger=Logger(Logger.QUIET))
    [(_, data)] = list(storage.load(str(path)))
    assert data["machine_info"]["device_name"] == "NVIDIA H200"
    return list(storage.load_benchmarks(str(path)))


def test_pytest_benchmark_file_loads_in_pytest_benchmark(tmp_path):
    out = tmp_path / "0001_kdbench.json"
    text = write_export(_frame(), "pytest-benchmark", out)
    assert out.read_text() == text
    doc = json.loads(text)
    assert set(doc) == {"machine_info", "commit_info", "benchmarks", "datetime", "version"}
    info = doc["machine_info"]
    assert (info["node"], info["machine"], info["system"], info["release"]) == (
        "gpu-a",
        "x86_64",
        "Linux",
        "5.15.0-1052-azure",
    )
    assert (info["device_arch"], info["backend"], info["torch_version"], info["cuda_version"]) == (
        "sm_90",
        "cuda",
        "2.5.1",
        "12.4",
    )
    assert info["cpu"]["brand_raw"] == "AMD EPYC 9454" and info["python_version"] == "3.11.9"
    assert doc["commit_info"] == {**doc["commit_info"], "id": HOST["git_commit"], "dirty": False, "project": "kdbench"}
    assert doc["datetime"] == "2025-01-02T03:04:05.678901+00:00"

    benches = {b["name"]: b for b in _load_with_pytest_benchmark(out)}
    names = {
        ("distill_step", 64): f"distill_step[{LABEL}]",
        ("student_inference", 1): f"student_inference[{LABEL} bs1]",
        ("student_inference", 64): f"student_inference[{LABEL} bs64]",
        ("teacher_inference", 1): f"teacher_inference[{LABEL} bs1]",
    }
    assert set(benches) == set(names.values())  # the failed and the quality rows are left out
    for key, samples in SAMPLES.items():
        b = benches[names[key]]
        s = np.sort(np.asarray(samples) / 1000)
        assert b["group"] == key[0] and b["fullname"] == f"kdbench::smoke::{names[key]}"
        assert b["rounds"] == len(samples) and b["iterations"] == 1
        assert (b["min"], b["max"], b["median"]) == (s[0], s[-1], np.median(s))
        assert b["mean"] == pytest.approx(np.mean(s), rel=1e-12)
        assert b["stddev"] == pytest.approx(np.std(s, ddof=1) if len(s) > 1 else 0, rel=1e-12)
        assert b["data"] == [ms / 1000 for ms in samples]
        if len(s) % 2 == 0:  # pytest-benchmark's quartiles: medians of the halves for even counts
            assert (b["q1"], b["q3"]) == (np.median(s[: len(s) // 2]), np.median(s[len(s) // 2 :]))
        else:
            assert s[0] <= b["q1"] <= b["median"] <= b["q3"] <= s[-1]
        assert b["params"]["device_name"] == "NVIDIA H200" and b["params"]["batch_size"] == key[1]
        assert b["extra_info"]["cell_id"] == "c0ffee1234567890" and b["extra_info"]["run_id"] == "run-a"


def test_pytest_benchmark_compare_command(tmp_path):
    out = tmp_path / "0001_kdbench.json"
    write_export(_frame(), "pytest-benchmark", out)
    cli = Path(sys.executable).with_name("pytest-benchmark")
    env = {**os.environ, "COLUMNS": "400"}
    r = subprocess.run(
        [str(cli), "compare", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr
    assert f"distill_step[{LABEL}]" in r.stdout and f"student_inference[{LABEL} bs1]" in r.stdout
    assert "benchmark 'distill_step'" in r.stdout  # grouped by measurement


def test_pytest_benchmark_names_stay_unique():
    other = {"cell_id": "beef000011112222", "precision": "bf16"}  # same label, another cell
    rows = [_row("distill_step", 64, [1.0, 2.0]), _row("distill_step", 64, [3.0, 4.0], **other)]
    names = [b["name"] for b in json.loads(export(_frame(rows), "pytest-benchmark"))["benchmarks"]]
    assert names == [f"distill_step[{LABEL} c0ffee12]", f"distill_step[{LABEL} beef0000]"]

    df = _frame([_row("distill_step", 64, [1.0, 2.0]), _row("distill_step", 64, [3.0])]).assign(repeat=[1, 2])
    names = [b["name"] for b in json.loads(export(df, "pytest-benchmark"))["benchmarks"]]
    assert names == [f"distill_step[{LABEL}]", f"distill_step[{LABEL} #2]"]

    twice = [_row("distill_step", 64, [1.0, 2.0]), _row("distill_step", 64, [3.0], run_id="run-b")]
    with pytest.raises(KdbenchError, match="one run at a time"):
        export(_frame(twice), "pytest-benchmark")


def test_export_errors():
    with pytest.raises(KdbenchError, match="csv, json, pytest-benchmark") as e:
        export(_frame(), "xml")
    assert "\n" not in str(e.value) and FORMATS == ("csv", "json", "pytest-benchmark")

    untimed = [r for r in _rows() if r["status"] != "ok" or r["measurement"] == "quality"]
    with pytest.raises(KdbenchError, match="no ok timing rows") as e:
        export(_frame(untimed), "pytest-benchmark")
    assert "\n" not in str(e.value)

    rows = _rows() + [_row("distill_step", 64, [1.0], hostname="gpu-b", device_name="AMD Instinct MI300X")]
    with pytest.raises(KdbenchError, match="one machine's run at a time") as e:
        export(_frame(rows), "pytest-benchmark")
    assert "gpu-a (NVIDIA H200)" in str(e.value) and "gpu-b (AMD Instinct MI300X)" in str(e.value)


def test_export_is_torch_free():
    script = (
        "import sys\n"
        "from kdbench.report.export import export\n"
        "from kdbench.core.schema import rows_to_table\n"
        "df = rows_to_table([{'measurement': 'distill_step', 'status': 'ok', 'samples_ms': [1.0]}]).to_pandas()\n"
        "export(df, 'pytest-benchmark'); export(df, 'csv'); export(df, 'json')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_export_of_a_run_folder(tmp_path):
    from kdbench.store import read_results
    from kdbench.store.results import open_run

    run = open_run(tmp_path / "res", "smoke", "smoke.yaml", run_id="run-a")
    run.write_part("c0ffee1234567890", _rows())
    df = read_results([run.path])
    back = json.loads(export(df, "json"))
    assert [r["samples_ms"] for r in back] == [*SAMPLES.values(), None, None]
    assert len(json.loads(export(df, "pytest-benchmark"))["benchmarks"]) == len(SAMPLES)


def test_export_command(tmp_path, capsys):
    from kdbench.cli import main
    from kdbench.store.results import open_run

    run = open_run(tmp_path / "res", "smoke", "smoke.yaml", run_id="run-a")
    run.write_part("c0ffee1234567890", _rows())
    out = tmp_path / "exports" / "run-a.json"
    assert main(["export", str(run.path), "--format", "pytest-benchmark", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"pytest-benchmark -> {out}\n"
    assert len(_load_with_pytest_benchmark(out)) == len(SAMPLES)
    assert main(["export", str(run.path), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("schema_version,run_id,suite,")
    assert main(["export", str(tmp_path / "nothing"), "--format", "json"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
