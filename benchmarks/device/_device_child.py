"""run_check.py's run of the check: its deadline and the errors that end a run early, its log (the runner's lines
and the child's output, to stdout and OUT/runner.log), and the child itself, in a session of its own whose whole
process group is terminated at the deadline and killed a grace period later.

Standard library only, for Python 3.9 and newer (a GPU box's own python).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

TIMED_OUT = 124


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class TimedOut(Exception):
    pass


class SetupError(Exception):
    """The check cannot be started; the message says why."""


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Log:
    """The runner's lines and the child's output, to stdout and (once opened) OUT/runner.log."""

    def __init__(self) -> None:
        self.file = None
        self.lock = threading.Lock()

    def open(self, path: Path) -> None:
        self.file = open(path, "wb", buffering=0)  # noqa: SIM115 (closed in main's finally)

    def write(self, data: bytes) -> None:
        with self.lock:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            if self.file is not None:
                self.file.write(data)

    def say(self, text: str) -> None:
        self.write("".join(f"[run_check] {line}\n" for line in text.splitlines() or [""]).encode())

    def line(self, text: str) -> None:
        self.write((text + "\n").encode())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(command: list[str], env: dict, deadline: Deadline, log: Log, grace: float) -> tuple[int, bool]:
    """Run command in a session of its own, its output pumped to log as it comes; at the deadline
    SIGTERM its process group (gpu_check then ends its stage and writes its files), and grace
    seconds later SIGKILL whatever is left of it. Returns (exit code, timed out)."""
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        bufsize=0,
    )
    assert child.stdout is not None
    fd = child.stdout.fileno()

    def pump() -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            log.write(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        child.wait(timeout=deadline.left())
    except subprocess.TimeoutExpired:
        timed_out = True
        log.write(b"\n")
        log.say(f"timed out after {deadline.seconds:.0f} s: terminating gpu_check's process group {child.pid}")
        _kill_group(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    except BaseException:
        _kill_group(child.pid, signal.SIGTERM)
        time.sleep(0.5)
        _kill_group(child.pid, signal.SIGKILL)
        child.wait()
        raise
    finally:
        # Whatever is left of the group (the check's own helpers, or all of it on a timeout) goes, so
        # nothing outlives the runner or holds the output pipe open.
        if not timed_out:
            reader.join(timeout=2.0)
        _kill_group(child.pid, signal.SIGKILL)
        if child.poll() is None:
            child.wait()
        reader.join(timeout=5.0)
        child.stdout.close()
    if timed_out:
        return TIMED_OUT, True
    code = child.returncode
    if code < 0:  # killed by a signal, not by the runner: the shell's convention
        log.say(f"gpu_check was killed by signal {-code}")
        code = 128 - code
    return code, False
