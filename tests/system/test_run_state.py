"""Runs that know whether they are complete (invocation records), the wall-time split of a timed-out job,
slow precisions skipped by measurement, and the plan-time checks that depend on where the run goes."""

from __future__ import annotations

import subprocess
import threading

import pytest

from kdbench.cli import main
from kdbench.config.schema import Suite
from kdbench.store.results import job_id, open_run, parse_job_id
from tests.support.helpers import run_folder, write_suite
from tests.support.paths import SUPPORT
from tests.support.suites import RESNET8, tiny_suite

TINY = tiny_suite(defaults={**RESNET8, "timing": {"warmup": 1}, "inference": {"batch_sizes": [4], "teacher": False}})


def test_job_ids_round_trip():
    assert job_id("abc", 1) == "abc" and job_id("abc", 3) == "abc-r3"
    assert parse_job_id("abc") == ("abc", 1) and parse_job_id("abc-r12") == ("abc", 12)
    assert parse_job_id("quality-0123") == ("quality-0123", 1)


def test_concurrent_invocations_never_lose_each_others_records(tmp_path):
    """Shards that run into one folder at once each write a record of their own (S3)."""
    folder = open_run(tmp_path, "s", "s.yaml", "sweep")
    planned = [f"c{i}" for i in range(8)]

    def shard(i: int) -> None:
        share = planned[i::4]
        record = folder.start_invocation(planned, share, shard=[i + 1, 4])
        for job in share:
            folder.write_part(job, [{"run_id": "sweep", "cell_id": job, "measurement": "distill_step"}])
        record.finish(stored=share, wall_time={"total": 1.0})

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = folder.invocations()
    assert sorted(tuple(r["shard"]) for r in records) == [(i, 4) for i in range(1, 5)]
    assert len(folder.wall_times()) == 4
    state = folder.state()
    assert state.complete and state.invocations == 4 and state.unfinished == 0
    assert state.describe() == "complete: 8 of 8 planned jobs stored"


def test_a_run_records_its_plan_and_a_killed_one_reads_incomplete(tmp_path, capsys):
    suite = write_suite(tmp_path / "s.yaml", **TINY, matrix={"seed": [0, 1]}, repeat=2)
    assert main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report", "--inline"]) == 0
    folder = run_folder(tmp_path / "res")
    [record] = folder.invocations()
    assert len(record["planned"]) == 4 and record["share"] == record["planned"] and record["repeats"] == 2
    assert sorted(record["stored"]) == sorted(record["planned"]) and record["wall_time"]["total"] > 0
    split = record["wall_time"]
    assert "environment capture" in split and "cold calls" in split
    assert sum(v for k, v in split.items() if k != "total") == pytest.approx(split["total"], abs=0.01)
    assert folder.state().complete
    # a part lost (as if the run had been killed before it): the run knows what is missing
    victim = folder.part_path(record["planned"][-1])
    victim.unlink()
    state = folder.state()
    assert state.complete is False and state.missing == {record["planned"][-1]}
    cell, repeat = parse_job_id(record["planned"][-1])
    assert state.missing_repeats(cell) == [repeat]
    assert "INCOMPLETE: 3 of 4 planned jobs stored" in state.describe()


def test_the_suite_commit_is_recorded_from_the_suites_own_repository(tmp_path):
    from kdbench.hw.environment import suite_commit

    assert suite_commit(tmp_path / "nowhere.yaml") is None  # not in a git repository
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    suite = write_suite(repo / "s.yaml", **TINY)
    subprocess.run([*git, "add", "s.yaml"], check=True)
    subprocess.run([*git, "commit", "-qm", "suite"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert suite_commit(suite) == head and len(head) == 12
    suite.write_text(suite.read_text() + "\n# changed\n")
    assert suite_commit(suite) == head + "+dirty"


def test_a_timed_out_job_keeps_its_wall_time_split(monkeypatch):
    """The worker tells the engine its split as it grows: a job stopped at its time-out keeps what it spent."""
    from kdbench.hw.backends import resolve
    from kdbench.run.workers import ProcessWorker, WorkerSetup

    monkeypatch.syspath_prepend(str(SUPPORT))  # faulty_models, for the worker process too
    from faulty_models import SpendsThenHangs

    worker = ProcessWorker(WorkerSetup(resolve("cpu"), False, 1))
    try:
        result = worker.run(SpendsThenHangs(), timeout_s=3.0)
    finally:
        worker.close()
    assert [r["status"] for r in result.rows] == ["timeout"]
    assert result.split["model building"] == pytest.approx(1.5) and result.split["warm-up"] == pytest.approx(0.25)


def _slow_bf16(monkeypatch, factor: float = 8.0):
    from kdbench.hw import speed

    slowdown = speed.Slowdown("bf16", factor, speed.MEASURED_NOW, {"bf16": 256, "fp32": 256})
    monkeypatch.setattr(
        speed, "slow_precisions", lambda used, *a, **k: {"bf16": slowdown} if "bf16" in set(used) else {}
    )


def test_a_precision_measured_slow_is_skipped_under_slow_precisions_skip(tmp_path, monkeypatch, capsys):
    _slow_bf16(monkeypatch)
    suite = write_suite(tmp_path / "s.yaml", **TINY, matrix={"precision": ["fp32", "bf16"]}, slow_precisions="skip")
    code = main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report", "--inline"])
    assert code == 0  # skipped is not a failure
    lines = capsys.readouterr().err.splitlines()
    warning = next(line for line in lines if "bf16 runs 8.0x slower than fp32 here" in line)
    assert "its 1 cell(s) are skipped (slow_precisions: skip)" in warning
    from kdbench.store import read_results

    df = read_results([run_folder(tmp_path / "res").path])
    assert set(df.loc[df["precision"].eq("fp32"), "status"]) == {"ok"}
    bf16 = df[df["precision"].eq("bf16")]
    assert set(bf16["status"]) == {"skipped"} and len(bf16) == 2
    assert bf16["error"].str.contains("skipped as slow .slow_precisions: skip.: bf16 runs 8.0x slower").all()


def test_a_slow_precision_is_warned_of_in_a_dry_run_and_measured_by_default(tmp_path, monkeypatch, capsys):
    _slow_bf16(monkeypatch, 5.5)
    suite = write_suite(tmp_path / "s.yaml", **TINY, matrix={"precision": ["fp32", "bf16"]})
    assert main(["run", str(suite), "--dry-run", "--out", str(tmp_path / "res")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert any("bf16 runs 5.5x slower than fp32 here" in line and "1 cell(s) use it" in line for line in lines)
    assert not (tmp_path / "res").exists()


def test_the_plan_time_budget_check_knows_the_backend(tmp_path):
    """S1: `where: {dist_backend: nccl}` matches data-parallel cells of a GPU run, not of a CPU run."""
    from kdbench.core.errors import KdbenchError
    from kdbench.run.plan import plan_jobs

    raw = {
        **TINY,
        "matrix": {"world_size": [1, 2]},
        "budgets": [{"measurement": "distill_step", "max": 100, "where": {"dist_backend": "nccl"}}],
    }
    suite = Suite.model_validate(raw).located(tmp_path / "s.yaml", {})
    assert len(plan_jobs(suite, backend_name="cuda").jobs) == 2
    with pytest.raises(KdbenchError, match="matches no measurement of the plan"):
        plan_jobs(suite, backend_name="cpu")


def test_a_teacher_inference_is_reused_only_under_the_same_timing_and_world_size():
    """N2: cells that time their teacher differently, or run on several ranks, measure it themselves."""
    from kdbench.config.plan import Cell
    from kdbench.run.jobs import CellJob
    from tests.support.helpers import make_config

    def keys(**overrides):
        return CellJob(Cell(0, "c", make_config(**overrides))).teacher_keys()

    same = keys()
    assert keys(seed=0) == same
    assert keys(timing={"warmup": 1, "min_iters": 5, "min_time_s": 0.0}) != same
    assert keys(timing={"warmup": 1, "min_iters": 3, "min_time_s": 0.0, "cell_budget_s": 10}) != same
    assert keys(world_size=2) != same
    assert keys(inference={"batch_sizes": [1, 4, 8]}) != same  # another share of the cell's time budget
