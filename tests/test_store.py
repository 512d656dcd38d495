"""The parquet store: schema = README, atomic appends, readable by pandas, pyarrow and duckdb."""

import re
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kdbench.errors import KdbenchError
from kdbench.store.schema import (
    COLUMN_NAMES,
    COLUMNS,
    SCHEMA,
    ResultWriter,
    read_results,
    result_files,
    schema_markdown,
)

README = Path(__file__).resolve().parent.parent / "README.md"


def _row(i, **kw):
    row = {
        "schema_version": 1,
        "run_id": "r1",
        "suite": "s",
        "cell_id": f"c{i}",
        "measurement": "distill_step",
        "status": "ok",
        "batch_size": 8,
        "median_ms": 1.5 + i,
        "samples_ms": [1.0, 2.0, 1.5 + i],
        "timestamp": datetime(2026, 1, 1, tzinfo=UTC),
        "noisy": False,
    }
    row.update(kw)
    return row


def test_readme_documents_every_column_in_order():
    text = README.read_text()
    assert schema_markdown() in text, "README's results table differs from kdbench.store.schema.COLUMNS"
    table = text[text.index("| column | type | unit | meaning |") :].split("\n\n")[0]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M)
    assert documented == list(COLUMN_NAMES)


def test_required_columns_present():
    required = [
        "schema_version",
        "run_id",
        "suite",
        "cell_id",
        "measurement",
        "status",
        "error",
        "batch_size",
        "teacher",
        "student",
        "method",
        "precision",
        "teacher_precision",
        "backend",
        "device_name",
        "torch_version",
        "n",
        "median_ms",
        "mean_ms",
        "std_ms",
        "iqr_ms",
        "p05_ms",
        "p95_ms",
        "min_ms",
        "max_ms",
        "first_ms",
        "samples_ms",
        "throughput",
    ]
    assert set(required) <= set(COLUMN_NAMES)
    assert all(c.doc for c in COLUMNS)
    assert all(c.unit == "ms" for c in COLUMNS if c.name.endswith("_ms"))


def test_append_is_atomic_and_cumulative(tmp_path):
    path = tmp_path / "run.parquet"
    w = ResultWriter(path)
    w.append([_row(0)])
    w.append([_row(1), _row(2, status="failed", error="boom", median_ms=None, samples_ms=None)])
    table = pq.read_table(path)
    assert table.schema.equals(SCHEMA, check_metadata=False)
    assert table.num_rows == 3
    assert table.column("cell_id").to_pylist() == ["c0", "c1", "c2"]
    assert table.column("samples_ms").to_pylist()[1] == [1.0, 2.0, 2.5]
    assert table.column("error").to_pylist() == [None, None, "boom"]
    assert [p.name for p in tmp_path.iterdir()] == ["run.parquet"]  # no temporary left behind
    # a new writer on the same file continues it
    ResultWriter(path).append([_row(3)])
    assert pq.read_table(path).num_rows == 4


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "run.parquet"
    w = ResultWriter(path)
    w.append([_row(0)])

    def broken(table, where, **kw):
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError):
        w.append([_row(1)])
    monkeypatch.undo()
    assert pq.read_table(path).column("cell_id").to_pylist() == ["c0"]
    assert [p.name for p in tmp_path.iterdir()] == ["run.parquet"]


def test_unknown_column_is_a_bug():
    from kdbench.store.schema import rows_to_table

    with pytest.raises(ValueError, match="not in the schema"):
        rows_to_table([{"median": 1.0}])


def test_read_by_pandas_pyarrow_and_duckdb(tmp_path):
    import duckdb  # a test dependency: the files must be readable by it as they are

    ResultWriter(tmp_path / "a.parquet").append([_row(0), _row(1)])
    ResultWriter(tmp_path / "sub" / "b.parquet").append([_row(2)])
    df = read_results([tmp_path])
    assert sorted(df["cell_id"]) == ["c0", "c1", "c2"]
    assert df["median_ms"].sum() == pytest.approx(1.5 + 2.5 + 3.5)
    got = duckdb.sql(f"select count(*), max(median_ms) from read_parquet('{tmp_path}/**/*.parquet')").fetchall()[0]
    assert got == (3, 3.5)
    assert len(result_files([tmp_path / "a.parquet", tmp_path / "sub"])) == 2


def test_read_errors_are_user_errors(tmp_path):
    with pytest.raises(KdbenchError, match="no .parquet result files"):
        read_results([tmp_path])
    with pytest.raises(KdbenchError, match="no such file"):
        read_results([tmp_path / "missing"])
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(KdbenchError, match="not a readable parquet"):
        read_results([tmp_path])


def test_reader_never_sees_a_half_written_file(tmp_path):
    import threading

    writer = ResultWriter(tmp_path / "run.parquet")
    writer.append([_row(0)])
    stop = threading.Event()

    def write():
        for i in range(1, 60):
            writer.append([_row(i, samples_ms=[float(j) for j in range(500)])])
        stop.set()

    t = threading.Thread(target=write)
    t.start()
    reads = []
    while not stop.is_set():
        reads.append(len(read_results([tmp_path])))  # raises on a torn or temporary file
    t.join()
    assert reads and all(1 <= n <= 60 for n in reads)
    assert reads == sorted(reads)  # each read sees a complete, later-or-equal file
    assert len(read_results([tmp_path])) == 60


def test_two_runs_started_together_get_distinct_files():
    from kdbench.run.engine import new_run_id

    now = datetime(2026, 1, 1, tzinfo=UTC)
    ids = {new_run_id("my suite/../x", now) for _ in range(50)}
    assert len(ids) == 50
    # a suite name cannot steer the file out of the results folder
    assert all(i.startswith("my-suite-..-x-20260101T000000Z-") and "/" not in i for i in ids)
