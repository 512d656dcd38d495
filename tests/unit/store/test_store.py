"""The store: schema = docs/results.md, a run as a folder of atomic parts, readable as one dataset by pandas,
pyarrow and duckdb, and the single-file runs of schema version 1 still readable."""

import json
import re
import threading
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from kdbench.core.errors import KdbenchError
from kdbench.core.schema import (
    COLUMN_NAMES,
    COLUMNS,
    DERIVED_COLUMNS,
    SCHEMA,
    STORED_SCHEMA,
    Row,
    rows_to_table,
    schema_markdown,
)
from kdbench.store.files import write_parquet
from kdbench.store.results import (
    MANIFEST,
    RunFolder,
    check_run_id,
    new_run_id,
    newest_run,
    open_run,
    read_results,
    result_files,
)
from tests.support.paths import ROOT
from tests.support.rows import result_row

RESULTS_DOC = ROOT / "docs" / "results.md"


def _row(i, **columns) -> Row:
    """Cell ``c<i>``'s step in run r1 of suite s, its median 1.5 + i ms."""
    row = result_row(schema_version=2, run_id="r1", suite="s", cell_id=f"c{i}", median_ms=1.5 + i)
    return row | {
        "samples_ms": [1.0, 2.0, 1.5 + i],
        "timestamp": datetime(2026, 1, 1, tzinfo=UTC),
        "noisy": False,
        **columns,
    }


def test_the_results_page_documents_every_column_in_order():
    text = RESULTS_DOC.read_text()  # a generated block (python -m kdbench.docgen)
    assert schema_markdown() in text, "docs/results.md's column table differs from kdbench.core.schema.COLUMNS"
    table = text[text.index("| column | type | unit | meaning |") :].split("\n\n")[0]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M)
    assert documented == list(COLUMN_NAMES)


def test_required_columns_present_and_derived_ones_not_stored():
    required = (
        "schema_version run_id suite cell_id measurement status error batch_size teacher student method precision "
        "teacher_precision backend device_name torch_version n median_ms mean_ms std_ms iqr_ms p05_ms p95_ms min_ms "
        "max_ms first_ms samples_ms throughput"
    ).split()
    assert set(required) <= set(STORED_SCHEMA.names)
    assert all(c.doc for c in COLUMNS)
    assert all(c.unit == "ms" for c in COLUMNS if c.name.endswith("_ms"))
    assert {"speedup_vs_teacher", "scaling_efficiency", "mfu", "teacher_cache_payback_steps"} <= set(DERIVED_COLUMNS)
    assert not set(DERIVED_COLUMNS) & set(STORED_SCHEMA.names)
    assert STORED_SCHEMA.names + list(DERIVED_COLUMNS) == sorted(
        SCHEMA.names, key=STORED_SCHEMA.names.__contains__, reverse=True
    )


def test_unknown_or_derived_column_in_a_row_is_a_bug():
    with pytest.raises(ValueError, match="not stored"):
        rows_to_table([{"median": 1.0}])
    with pytest.raises(ValueError, match="speedup_vs_teacher"):
        rows_to_table([{**_row(0), "speedup_vs_teacher": 2.0}])  # a plain dict: a Row refuses it where it is set


def test_a_run_is_a_folder_of_parts_written_once(tmp_path):
    run = open_run(tmp_path, "s", "suites/s.yaml")
    assert run.path.parent == tmp_path and json.loads((run.path / MANIFEST).read_text())["suite"] == "s"
    run.write_part("c0", [_row(0)])
    run.write_part(
        "c1", [_row(1), _row(2, cell_id="c1", status="failed", error="boom", median_ms=None, samples_ms=None)]
    )
    assert [p.name for p in run.parts()] == ["part-c0.parquet", "part-c1.parquet"]
    assert run.stored_job_ids() == {"c0", "c1"}
    part = pq.read_table(run.part_path("c1"))
    assert part.schema.equals(STORED_SCHEMA, check_metadata=False) and part.num_rows == 2
    assert part.column("error").to_pylist() == [None, "boom"]
    assert sorted(p.name for p in run.path.iterdir()) == [MANIFEST, "part-c0.parquet", "part-c1.parquet"]
    assert oct(run.part_path("c0").stat().st_mode & 0o777) != "0o600"  # readable like any file the user writes
    # the same run id continues the folder; another suite may not write into it
    again = open_run(tmp_path, "s", "suites/s.yaml", run.run_id)
    assert again == run and again.stored_job_ids() == {"c0", "c1"}
    with pytest.raises(KdbenchError, match="holds a run of suite 's'"):
        open_run(tmp_path, "other", "x.yaml", run.run_id)


def test_failed_write_leaves_no_part(tmp_path, monkeypatch):
    run = open_run(tmp_path, "s", "s.yaml")
    run.write_part("c0", [_row(0)])

    def broken(table, where, **kw):
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError):
        run.write_part("c1", [_row(1)])
    monkeypatch.undo()
    assert run.stored_job_ids() == {"c0"}
    assert sorted(p.name for p in run.path.iterdir()) == [MANIFEST, "part-c0.parquet"]


def test_a_run_folder_is_one_dataset_for_pandas_pyarrow_and_duckdb(tmp_path):
    import duckdb  # a test dependency: the folders must be readable by it as they are
    import pandas as pd

    run = open_run(tmp_path, "s", "s.yaml")
    run.write_part("c0", [_row(0), _row(1)])
    run.write_part("c1", [_row(2)])
    (run.path / ".part-c2.parquet.123.tmp").write_bytes(b"a write in flight")  # hidden: skipped by every reader
    from kdbench.measure.levers import tunableop_file

    # TunableOp's results file lives in the run folder: "_"-prefixed, as _run.json, so readers skip it
    tunableop_file(str(run.path), "NVIDIA H200").write_text("Validator,PT_VERSION,2.14.1\n")
    assert pd.read_parquet(run.path)["median_ms"].sum() == pytest.approx(1.5 + 2.5 + 3.5)
    assert ds.dataset(run.path).to_table().num_rows == 3
    got = duckdb.sql(f"select count(*), max(median_ms) from read_parquet('{run.path}/*.parquet')").fetchall()[0]
    assert got == (3, 3.5)
    df = read_results([tmp_path])  # a folder of runs
    assert sorted(df["cell_id"]) == ["c0", "c1", "c2"]
    assert list(df.columns) == list(COLUMN_NAMES)  # derived columns added at read time
    assert len(result_files([run.part_path("c0"), run.path])) == 3


def test_newest_run_of_a_suite(tmp_path):
    assert newest_run(tmp_path, "s") is None
    first = open_run(tmp_path, "s", "s.yaml", "a-run")
    other = open_run(tmp_path, "t", "t.yaml", "b-run")
    assert newest_run(tmp_path, "s") == first and newest_run(tmp_path, "t") == other
    second = open_run(tmp_path, "s", "s.yaml", "c-run")
    assert newest_run(tmp_path, "s") == second


def test_run_ids_are_checked():
    assert check_run_id("sweep-2026.11_a") == "sweep-2026.11_a"
    for bad in ("", ".hidden", "_x", "-x", "a/b", "../x", "probes", "traces", "a b"):
        with pytest.raises(KdbenchError, match="--run-id"):
            check_run_id(bad)


def test_read_errors_are_user_errors(tmp_path):
    with pytest.raises(KdbenchError, match="no .parquet result files"):
        read_results([tmp_path])
    with pytest.raises(KdbenchError, match="no such file"):
        read_results([tmp_path / "missing"])
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(KdbenchError, match=r"x\.parquet: not a readable parquet"):
        read_results([tmp_path])


def test_reader_never_sees_a_half_written_part(tmp_path):
    run = open_run(tmp_path, "s", "s.yaml")
    run.write_part("c0", [_row(0)])
    stop = threading.Event()

    def write():
        for i in range(1, 60):
            run.write_part(f"c{i}", [_row(i, samples_ms=[float(j) for j in range(500)])])
        stop.set()

    t = threading.Thread(target=write)
    t.start()
    reads = []
    while not stop.is_set():
        reads.append(len(read_results([tmp_path])))  # raises on a torn or temporary file
    t.join()
    assert reads and all(1 <= n <= 60 for n in reads)
    assert reads == sorted(reads)  # parts only ever appear
    assert len(read_results([tmp_path])) == 60


def test_version_1_single_file_runs_are_still_read(tmp_path):
    # Schema 1: one file per run, derived columns stored; read_results recomputes them from the rows.
    v1 = pa.schema([f for f in SCHEMA if f.name not in ("teacher_cache_saving_ms", "teacher_cache_payback_steps")])
    student = _row(0, schema_version=1, measurement="student_inference", batch_size=1, median_ms=2.0)
    rows = [
        {**student, "speedup_vs_teacher": 9.9},  # stored as version 1 did: a plain dict, no current Row
        _row(0, schema_version=1, measurement="teacher_inference", batch_size=1, median_ms=6.0),
    ]
    table = pa.Table.from_pydict({f.name: [r.get(f.name) for r in rows] for f in v1}, schema=v1)
    write_parquet(table, tmp_path / "old-run.parquet")
    run = open_run(tmp_path, "s", "s.yaml")
    run.write_part("c9", [_row(9)])
    df = read_results([tmp_path])
    assert sorted(df["schema_version"]) == [1, 1, 2]
    student = df[df["measurement"] == "student_inference"].iloc[0]
    assert student["speedup_vs_teacher"] == pytest.approx(3.0)  # recomputed, not the stored 9.9


def test_two_runs_started_together_get_distinct_ids():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    ids = {new_run_id("my suite/../x", now) for _ in range(50)}
    assert len(ids) == 50
    # a suite name cannot steer the folder out of the results folder
    assert all(i.startswith("my-suite-..-x-20260101T000000Z-") and "/" not in i for i in ids)
    assert all(RunFolder(Path("/r") / i).run_id == i for i in ids)


def test_a_row_is_checked_where_it_is_made():
    """Rows are typed records tied to COLUMNS: a misspelled or derived column, or a value of the wrong type, is
    an error at the line that writes it, not when the part is stored."""
    import pickle

    import numpy as np

    from kdbench.core.schema import Row

    row = Row(measurement="distill_step", batch_size=4, median_ms=np.float64(1.5), n=np.int64(3), noisy=np.True_)
    row.update(samples_ms=[1.0, 2.0], notes=None)
    row["thin"] = False
    assert pickle.loads(pickle.dumps(row)) == row and isinstance(pickle.loads(pickle.dumps(row)), Row)
    assert isinstance(row | {"status": "ok"}, Row)
    with pytest.raises(KeyError, match="'medain_ms' is not a column"):
        Row(medain_ms=1.0)
    with pytest.raises(KeyError, match="derived at read time"):
        row["speedup_vs_teacher"] = 2.0
    with pytest.raises(TypeError, match="batch_size is int64, got float 1.5"):
        row.update(batch_size=1.5)
    with pytest.raises(TypeError, match="noisy is bool, got str"):
        Row(noisy="yes")
    assert rows_to_table([row]).num_rows == 1
