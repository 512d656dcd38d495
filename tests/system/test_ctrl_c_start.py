"""Ctrl-C at any moment prints no traceback (issue 45, item 5): above all while a worker process imports torch,
the seconds after it starts and before it runs kdbench's code, when it used to print a 45-line KeyboardInterrupt
traceback beside the parent's clean line.  A real run, interrupted as a terminal does (SIGINT to the whole
foreground group) as soon as its first worker exists."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

from tests.support.helpers import foreground_run, kill_group, press_ctrl_c, write_suite
from tests.support.suites import tiny_suite


def _worker_of(pid: int) -> psutil.Process | None:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    return next((c for c in children if "multiprocessing" in " ".join(_cmdline(c))), None)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _sigint_ignored(pid: int) -> bool | None:
    """From /proc (Linux): whether the process ignores SIGINT (bit 2 of SigIgn); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigIgn:")).split()[1]
    except (OSError, StopIteration):
        return None
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


def test_ctrl_c_while_the_worker_imports_torch_prints_no_traceback(tmp_path):
    suite = write_suite(tmp_path / "s.yaml", **tiny_suite(name="ctrl-c"))
    cmd = [sys.executable, "-m", "kdbench", "run", str(suite), "--out", str(tmp_path / "res"), "--no-report"]
    proc = foreground_run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline, worker = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None and worker is None:
            worker = _worker_of(proc.pid)
            time.sleep(0.01)
        assert worker is not None, "no worker process was seen"
        ignored = _sigint_ignored(worker.pid)  # from its first instruction, before it imports anything
        time.sleep(0.2)  # the worker is importing torch now (seconds, even on an idle machine)
        out, err = press_ctrl_c(proc)
    finally:
        kill_group(proc)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 130, out[-2000:] + err
    assert "interrupted" in err and "resume with" in err, err
    assert ignored in (True, None)
