"""A continued run keeps the options it was started with (issue 45, item 5: a run started with `--repeat 3`, cut
short and resumed said "2 of 2 jobs already stored, 0 to go" and left a 1-repeat run): the run folder records them,
`--resume` alone uses them again, a resume that would change the plan is refused in one line naming the option and
both values, and a part that cannot be read counts as not stored.  Interrupted runs are simulated by removing a
stored part; tests/system/test_resume_interrupted.py interrupts a real one with Ctrl-C."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kdbench.cli import main
from kdbench.run.resume import GIVEN, OPTIONS, resume_command
from kdbench.store.results import INVOCATIONS_DIR, MANIFEST, RunFolder, job_id
from tests.support.helpers import run_folder, write_suite
from tests.support.suites import tiny_suite

TWO_CELLS = tiny_suite(name="resume", defaults={"inference": {"batch_sizes": []}}, matrix={"seed": [0, 1]})


def _run(suite: Path, out: Path, *extra: str) -> int:
    return main(["run", str(suite), "--out", str(out), "--no-report", "--inline", *extra])


def _repeats(folder: RunFolder) -> dict[str, list[int]]:
    """Per cell, the repeats its stored rows hold."""
    got: dict[str, list[int]] = {}
    for part in folder.parts():
        table = pq.read_table(part, columns=["cell_id", "repeat"]).to_pydict()
        for cell, r in zip(table["cell_id"], table["repeat"]):
            got.setdefault(cell, []).append(r)
    return {c: sorted(r) for c, r in got.items()}


@pytest.fixture
def started(tmp_path):
    """A `--repeat 2 --no-fit-check` run of two cells, its last job's part removed (as an interrupted run)."""
    suite, out = write_suite(tmp_path / "s.yaml", **TWO_CELLS), tmp_path / "res"
    assert _run(suite, out, "--repeat", "2", "--no-fit-check") == 0
    folder = run_folder(out)
    cells = sorted(_repeats(folder))
    folder.part_path(job_id(cells[1], 2)).unlink()
    return suite, out, folder


def test_the_folder_records_the_options_it_was_started_with(started):
    _, _, folder = started
    manifest = json.loads((folder.path / MANIFEST).read_text())
    [record] = [json.loads(p.read_text()) for p in (folder.path / INVOCATIONS_DIR).glob("*.json")]
    for doc in (manifest, record):
        assert doc[OPTIONS]["repeat"] == 2 and doc[OPTIONS]["fit_check"] is False and doc[OPTIONS]["threads"] == 1
        assert doc[OPTIONS]["device"] == "cpu" and doc[GIVEN] == ["repeat", "fit_check"]


def test_resume_alone_keeps_the_repeats_and_every_other_option(started, caplog):
    suite, out, folder = started
    caplog.clear()
    assert _run(suite, out, "--resume") == 0
    lines = [r.getMessage() for r in caplog.records]
    assert f"continuing run {folder.run_id} with the options it was started with: --repeat 2 --no-fit-check" in lines
    assert f"resuming run {folder.run_id}: 3 of 4 jobs already stored, 1 to go" in lines
    assert list(_repeats(folder).values()) == [[1, 2], [1, 2]]  # the removed repeat 2 measured again
    newest = sorted((folder.path / INVOCATIONS_DIR).glob("*.json"))[-1]
    record = json.loads(newest.read_text())
    assert record["repeats"] == 2 and record[OPTIONS]["fit_check"] is False  # kept, not the suite's true
    assert record["stored"] == [job_id(sorted(_repeats(folder))[1], 2)]


@pytest.mark.parametrize(
    ("given", "said_now", "said_then"),
    [
        (["--repeat", "1"], "--repeat 1", "--repeat 2"),
        (["--threads", "2"], "--threads 2", "--threads 1"),
        (["--profile"], "--profile", "without --profile"),
        (["--device", "cuda"], "--device cuda", "--device cpu"),
    ],
)
def test_a_resume_that_changes_the_plan_is_refused_naming_both_values(started, capsys, given, said_now, said_then):
    suite, out, folder = started
    before = sorted(p.name for p in folder.parts())
    capsys.readouterr()
    assert _run(suite, out, "--resume", *given) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{said_now}: run {folder.run_id} in {out} was started with {said_then}" in err[0], err[0]
    assert "start a new run" in err[0]
    assert sorted(p.name for p in folder.parts()) == before  # nothing ran


def test_the_suite_file_changing_a_plan_option_is_refused_too(started, capsys):
    suite, out, _ = started
    write_suite(suite, **{**TWO_CELLS, "threads": 2})  # the run's threads came from the suite: not kept
    assert _run(suite, out, "--resume") == 2
    err = capsys.readouterr().err
    assert "--threads not given: the suite's `threads: 2`" in err and "was started with --threads 1" in err, err


def test_a_larger_repeat_adds_repeats_and_options_that_keep_the_plan_may_change(started):
    suite, out, folder = started
    assert _run(suite, out, "--resume", "--repeat", "3", "--cell-timeout", "600") == 0
    assert list(_repeats(folder).values()) == [[1, 2, 3], [1, 2, 3]]
    record = json.loads(sorted((folder.path / INVOCATIONS_DIR).glob("*.json"))[-1].read_text())
    assert record[OPTIONS]["repeat"] == 3 and record[OPTIONS]["cell_timeout_s"] == 600
    assert record[GIVEN] == ["repeat", "fit_check", "cell_timeout_s"]


def test_a_folder_from_before_the_options_were_recorded_is_not_shrunk_silently(started, capsys):
    """Its records hold only `repeats`: a resume without --repeat is refused, not run at the suite's 1."""
    suite, out, folder = started
    for path in [folder.path / MANIFEST, *(folder.path / INVOCATIONS_DIR).glob("*.json")]:
        doc = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in doc.items() if k not in (OPTIONS, GIVEN)}))
    assert _run(suite, out, "--resume", "--no-fit-check") == 2
    err = capsys.readouterr().err
    assert "--repeat not given: the suite's `repeat: 1`" in err and "started with --repeat 2" in err, err
    assert _run(suite, out, "--resume", "--no-fit-check", "--repeat", "2") == 0
    assert list(_repeats(folder).values()) == [[1, 2], [1, 2]]


def test_a_corrupted_part_is_not_counted_as_stored_and_its_job_runs_again(tmp_path, caplog):
    suite, out = write_suite(tmp_path / "s.yaml", **TWO_CELLS), tmp_path / "res"
    assert _run(suite, out) == 0
    folder = run_folder(out)
    bad = folder.parts()[0]
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # cut short, as a full disk leaves it
    assert folder.stored_job_ids() == folder.stored_job_ids(readable=True) | {bad.name[5:-8]}
    assert _run(suite, out, "--resume") == 0
    assert any(f"{bad}: not a readable parquet file" in r.getMessage() for r in caplog.records)
    assert pq.read_table(bad).num_rows == 1  # measured again, its part whole
    assert list(_repeats(folder).values()) == [[1], [1]]
    assert folder.state().complete


def test_the_resume_command_carries_every_option(tmp_path):
    from kdbench import api
    from kdbench.run.resume import resolve

    suite = write_suite(tmp_path / "my suite.yaml", **TWO_CELLS)
    given = {
        "repeat": 3,
        "device": "cpu",
        "threads": None,
        "profile": True,
        "fit_check": False,
        "cell_timeout_s": 90.0,
        "allow_imports": None,
    }
    resolved = resolve(api.load_suite(suite), given, tmp_path / "res", None, False)
    args = argparse.Namespace(
        suite=suite,
        out=tmp_path / "res",
        resolved=resolved,
        shard=(2, 3),
        inline=False,
        no_report=True,
        report_dir=Path("reports"),
        judge_contended=True,
        allow_unjudged=False,
    )
    words = shlex.split(resume_command(args, "run-1"))
    assert words == [
        "kdbench", "run", str(suite), "--out", str(tmp_path / "res"), "--resume", "--run-id", "run-1",
        "--repeat", "3", "--device", "cpu", "--profile", "--no-fit-check", "--cell-timeout", "90",
        "--shard=2/3", "--no-report", "--judge-contended",
    ]  # fmt: skip


def test_run_id_of_an_existing_run_keeps_its_options_too(tmp_path):
    """The shards of one sweep, or a run continued by its id: the second invocation without --repeat keeps 2."""
    suite, out = write_suite(tmp_path / "s.yaml", **TWO_CELLS), tmp_path / "res"
    assert _run(suite, out, "--run-id", "sweep", "--repeat", "2", "--shard", "1/2") == 0
    assert _run(suite, out, "--run-id", "sweep", "--shard", "2/2") == 0
    folder = RunFolder(out / "sweep")
    assert list(_repeats(folder).values()) == [[1, 2], [1, 2]] and folder.state().complete
