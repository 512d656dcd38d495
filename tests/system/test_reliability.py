"""A failing cell is a result, not a crash; a killed run resumes; Ctrl-C keeps what is done."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kdbench.cli import main
from kdbench.store import read_results
from tests.support.helpers import foreground_run, kill_group, press_ctrl_c, run_folder, write_suite
from tests.support.paths import ROOT, SUPPORT
from tests.support.suites import RESNET8, tiny_suite

FAULTS = tiny_suite(
    name="faults",
    allow_imports=True,
    cell_timeout_s=20,
    defaults={
        "data": {"kind": "synthetic", "shape": [1, 8, 8], "num_classes": 10},
        "timing": {"min_iters": 2},
        "inference": {"batch_sizes": [2]},
    },
)


@pytest.mark.slow
def test_injected_failures_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SUPPORT))  # the spawned worker inherits sys.path
    students = [
        "linear",
        "faulty_models:raising",
        "faulty_models:nan",
        "faulty_models:oom",
        "faulty_models:segfault",
        "linear",
        "faulty_models:killed",
        "faulty_models:hang",
        "linear",
    ]
    # `cases` gives each cell its own seed, so the three good `linear` cells are distinct cells
    cases = [{"pair": {"teacher": "linear", "student": s}, "seed": i} for i, s in enumerate(students)]
    suite = write_suite(tmp_path / "faults.yaml", **FAULTS, matrix={"cases": cases})
    rc = main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report"])
    assert rc == 1
    df = read_results([tmp_path / "res"])
    step = df[df.measurement == "distill_step"].sort_values("seed")
    assert list(step["student"]) == students  # every cell ran, in plan order
    got = dict(zip(step["seed"], zip(step["status"], step["error"].fillna(""))))
    assert got[0] == ("ok", "") and got[5] == ("ok", "") and got[8] == ("ok", "")
    assert got[1][0] == "failed" and "injected failure" in got[1][1]
    assert got[2][0] == "failed" and "not finite" in got[2][1]
    assert got[3][0] == "oom" and "out of memory" in got[3][1]
    assert got[4][0] == "failed" and "SIGSEGV" in got[4][1]
    assert got[6][0] == "failed" and "SIGKILL" in got[6][1]
    assert got[7][0] == "timeout" and "20 s" in got[7][1]
    # the cells after each failure ran in a working worker and measured their inference too
    ok_inf = df[(df.measurement == "student_inference") & df.seed.isin([5, 8])]
    assert list(ok_inf["status"]) == ["ok", "ok"]
    err = capsys.readouterr().err
    assert "6 job(s) had failures" in err


@pytest.mark.slow
def test_failure_cells_after_good_ones_keep_order(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SUPPORT))
    pairs = [{"teacher": "linear", "student": s} for s in ["faulty_models:segfault", "linear", "faulty_models:raising"]]
    suite = write_suite(tmp_path / "s.yaml", **FAULTS, matrix={"pair": pairs})
    assert main(["run", str(suite), "--out", str(tmp_path), "--no-report"]) == 1
    rows = read_results([run_folder(tmp_path).path]).sort_values("timestamp", kind="stable").to_dict("records")
    steps = [(r["student"], r["status"]) for r in rows if r["measurement"] == "distill_step"]
    assert steps == [("faulty_models:segfault", "failed"), ("linear", "ok"), ("faulty_models:raising", "failed")]
    # a cell whose worker died has all its planned rows, each marked
    seg = [r for r in rows if r["student"] == "faulty_models:segfault"]
    assert len(seg) == 3 and all(r["status"] == "failed" for r in seg)


SLOW = tiny_suite(
    name="killme", defaults={**RESNET8, "batch_size": 8, "timing": {"min_time_s": 1.0}}, matrix={"seed": [0, 1, 2, 3]}
)


def _stored_cells(out: Path) -> list[str]:
    ids = []
    for f in out.glob("*/part-*.parquet"):
        ids += pq.read_table(f, columns=["cell_id"]).column("cell_id").to_pylist()
    return ids


@pytest.mark.slow
def test_sigkill_then_resume_stores_every_cell_exactly_once(tmp_path):
    suite, out = write_suite(tmp_path / "slow.yaml", **SLOW), tmp_path / "res"
    cmd = [sys.executable, "-m", "kdbench", "run", str(suite), "--out", str(out), "--no-report"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if len(set(_stored_cells(out))) >= 1:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its worker, at once
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()
    before = set(_stored_cells(out))
    assert 1 <= len(before) < 4
    r = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "already stored" in r.stdout
    ids = _stored_cells(out)
    assert len(set(ids)) == 4
    assert len(ids) == 4 * 3  # each cell's 3 rows once: nothing lost, nothing duplicated
    run = run_folder(out)  # the resumed run went on in the same folder
    assert len(run.parts()) == 4
    assert not [p for p in run.path.iterdir() if p.suffix == ".tmp" and not p.name.startswith(".")]
    # resuming a complete run measures nothing
    again = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 jobs" in again.stdout
    assert len(_stored_cells(out)) == 12


@pytest.mark.slow
def test_ctrl_c_keeps_stored_cells_and_prints_the_resume_command(tmp_path):
    suite, out = write_suite(tmp_path / "slow.yaml", **SLOW), tmp_path / "res"
    cmd = [sys.executable, "-m", "kdbench", "run", str(suite), "--out", str(out), "--no-report"]
    proc = foreground_run(cmd)  # Ctrl-C reaches it as a terminal's foreground job
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not _stored_cells(out):
            time.sleep(0.2)
        finished_first = proc.poll()  # not None: the run ended before any cell was seen stored
        out_text, err = press_ctrl_c(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, (finished_first, _stored_cells(out), out_text[-2000:], err)
    assert "--resume" in err and "Traceback" not in err
    stored = set(_stored_cells(out))
    assert 1 <= len(stored) <= 4


@pytest.mark.slow
def test_a_job_that_keeps_logging_still_times_out_and_its_lines_reach_the_parent(monkeypatch):
    from kdbench.hw.backends import resolve
    from kdbench.run.workers import ProcessWorker, WorkerSetup
    from tests.support.helpers import log_lines

    monkeypatch.syspath_prepend(str(SUPPORT))  # faulty_models, for the worker process too
    from faulty_models import ChattyJob

    worker = ProcessWorker(WorkerSetup(resolve("cpu"), False, 1))
    try:
        with log_lines() as lines:
            result = worker.run(ChattyJob(), timeout_s=3.0)  # returns: the lines do not starve the time-out
    finally:
        worker.close()
    assert [r["status"] for r in result.rows] == ["timeout"] and "3 s" in result.rows[0]["error"]
    assert lines.count("still busy") > 10


@pytest.mark.slow
def test_a_silent_worker_ends_at_its_silence_limit_with_its_last_word(monkeypatch):
    """Issue 45: a cell printed nothing for 12 minutes.  A worker that goes silent (here: it stops itself) is
    stopped once no heartbeat came for SILENCE_S, long before the cell's time-out, and its row says why and what
    it was last heard to do; a busy worker that keeps beating runs to its time-out, whose row says the same."""
    from kdbench.hw.backends import resolve
    from kdbench.run import workers
    from kdbench.run.workers import ProcessWorker, WorkerSetup

    monkeypatch.syspath_prepend(str(SUPPORT))  # faulty_models, for the worker process too
    from faulty_models import ChattyJob, FrozenJob

    monkeypatch.setattr(workers, "SILENCE_S", 3 * workers.HEARTBEAT_S)
    worker = ProcessWorker(WorkerSetup(resolve("cpu"), False, 1))
    try:
        began = time.monotonic()
        frozen = worker.run(FrozenJob(), timeout_s=600)
        took = time.monotonic() - began
        chatty = worker.run(ChattyJob(), timeout_s=3.0 * workers.HEARTBEAT_S)  # a fresh worker: it beats
    finally:
        worker.close()
    (row,) = frozen.rows
    assert row["status"] == "timeout" and took < 120, took
    assert row["error"].startswith("the worker went silent: no heartbeat for ")
    assert "last heard " in row["error"] and "about to freeze" in row["error"]
    (row,) = chatty.rows
    assert row["status"] == "timeout" and row["error"].startswith("the job exceeded its time-out of 15 s")
    assert "still busy" in row["error"]


def test_a_progress_line_prints_the_whole_first_line_of_an_error():
    """Issue 45: an OOM's progress line was cut at "you tried to all"; it now ends with the bytes asked."""
    from kdbench.run.progress import summary_line

    error = (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: you tried to "
        "allocate 1074790400000 bytes. [out of memory: asked 1074790400000 bytes (1000.98 GiB) of the host]"
    )
    oom = {"measurement": "distill_step", "batch_size": 65536, "status": "oom", "error": error}
    assert summary_line([oom]) == f"OOM: {error}"
    ok = {**oom, "measurement": "teacher_inference", "status": "ok", "median_ms": 1.0, "throughput": 2.0}
    assert summary_line([oom, dict(ok, status="failed")]).endswith("of the host]")


@pytest.mark.slow
def test_a_device_error_is_stored_and_the_next_job_gets_a_fresh_worker(monkeypatch):
    # After an illegal address or a device-side assert the process's CUDA/HIP context is unusable:
    # the worker stores the job's rows, then ends, and the next job starts a new one.
    from kdbench.config.plan import Cell
    from kdbench.hw.backends import resolve
    from kdbench.run.jobs import CellJob
    from kdbench.run.workers import ProcessWorker, WorkerSetup
    from tests.support.helpers import make_config

    monkeypatch.syspath_prepend(str(SUPPORT))
    shape = {"shape": [1, 4, 4], "num_classes": 4}
    bad = make_config(pair={"teacher": "linear", "student": "faulty_models:device_error"}, data=shape)
    good = make_config(pair={"teacher": "linear", "student": "linear"}, data=shape)
    worker = ProcessWorker(WorkerSetup(resolve("cpu"), True, 1))
    try:
        first = worker.run(CellJob(Cell(0, "bad", bad)), timeout_s=120)
        second = worker.run(CellJob(Cell(1, "good", good)), timeout_s=120)
    finally:
        worker.close()
    step = first.rows[0]
    assert step["status"] == "failed" and "illegal memory access" in step["error"]
    # G12: the rest of the job is not run in the poisoned context, where it would fail with sticky errors
    # naming some later kernel: failed rows that name the cause
    assert [r["status"] for r in first.rows[1:]] == ["failed"] * 4
    assert all(
        r["error"].startswith("not run: an earlier measurement of this job lost the device context")
        for r in first.rows[1:]
    )
    assert all("illegal memory access" in r["error"] for r in first.rows[1:])
    assert all(r["status"] == "ok" for r in second.rows)
    assert worker.started == 2  # the poisoned worker ended after storing its rows


def test_device_errors_are_told_from_ordinary_failures():
    import torch

    from kdbench.measure.failures import device_fatal

    assert device_fatal(RuntimeError("CUDA error: device-side assert triggered"))
    assert device_fatal(RuntimeError("HIP error: hipErrorIllegalAddress"))
    assert device_fatal(RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"))
    assert device_fatal(RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"))
    assert device_fatal(RuntimeError("miopenStatusUnknownError"))
    assert not device_fatal(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"))  # a shape, not the context
    assert not device_fatal(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not device_fatal(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    if hasattr(torch, "AcceleratorError"):
        assert device_fatal(torch.AcceleratorError("unspecified launch failure"))


def test_an_allocation_the_host_cannot_satisfy_is_oom_with_the_bytes_asked():
    """The CPU allocator's refusal is a RuntimeError, not torch.OutOfMemoryError: stored as oom, not failed, with
    the bytes it asked for and whose memory (issue 30)."""
    import torch

    from kdbench.core.names import Status
    from kdbench.hw.backends import Backend
    from kdbench.measure.failures import asked_bytes, error_text, is_oom, status_of
    from kdbench.run.cell import guarded

    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**62, dtype=torch.uint8)  # beyond any address space: the allocator refuses it at once
    exc = caught.value
    assert not isinstance(exc, torch.OutOfMemoryError) and is_oom(exc)
    assert status_of(exc) == Status.OOM
    assert asked_bytes(exc) == 2**62
    assert error_text(exc).endswith(f"[out of memory: asked {2**62} bytes ({2**62 / 2**30:.2f} GiB) of the host]")

    def step():
        torch.empty(2**62, dtype=torch.uint8)

    row = guarded("distill_step", 4, Backend(name="cpu", device=torch.device("cpu")), step)
    assert row["status"] == Status.OOM and f"asked {2**62} bytes" in row["error"] and "of the host" in row["error"]


def test_every_allocation_failure_is_oom_and_others_are_not():
    import torch

    from kdbench.core.names import Status
    from kdbench.measure.failures import asked_bytes, error_text, status_of

    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity")
    assert status_of(cuda) == Status.OOM and asked_bytes(cuda) == 3 * 2**29
    assert error_text(cuda).endswith(f"[out of memory: asked {3 * 2**29} bytes (1.50 GiB) of the device]")
    mps = RuntimeError(
        "MPS backend out of memory (MPS allocated: 1.00 GB). Tried to allocate 256.00 MiB on private pool"
    )
    assert status_of(mps) == Status.OOM and asked_bytes(mps) == 2**28
    assert status_of(RuntimeError("HIP error: hipErrorOutOfMemory")) == Status.OOM
    assert status_of(MemoryError()) == Status.OOM and "of the host" in error_text(MemoryError())
    assert status_of(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) == Status.FAILED
    assert error_text(ValueError("bad\nsecond line")) == "ValueError: bad"
