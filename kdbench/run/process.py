"""What a process kdbench starts does for itself: die with its parent, beat (its heartbeat through a pipe it
shares with its job's messages); how it is started: deaf to Ctrl-C; and what its parent last heard of it."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (even by kill -9)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def deaf_to_ctrl_c() -> Iterator[None]:
    """Start child processes inside this block with SIGINT ignored from their first instruction.

    Ctrl-C signals the terminal's whole foreground group, the workers too; a spawned worker sets SIGINT aside only
    once it runs its own code, after seconds of importing torch, so a Ctrl-C in those seconds printed a 45-line
    KeyboardInterrupt traceback beside the parent's one clean line.  An ignored SIGINT survives fork and exec, and
    a Python started with it ignored installs no KeyboardInterrupt handler, so the child stays quiet and the parent
    alone answers (exit 130).  SIGINT is blocked across the switch, so a Ctrl-C in this short window stays pending
    (Linux keeps a blocked signal even while it is ignored) and reaches the parent once its handler is back.  Only
    the main thread may set handlers: elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = hasattr(signal, "pthread_sigmask")
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Locked:
    """A pipe end whose ``send`` the job's thread and the heartbeat's share (a Connection is not thread-safe)."""

    def __init__(self, conn: Any):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, message: Any) -> None:
        with self.lock:
            self.conn.send(message)

    def recv(self) -> Any:
        return self.conn.recv()


def beat(conn: Locked, every_s: float) -> None:
    """Send ("alive",) every ``every_s`` seconds until the pipe closes: a worker's heartbeat, from a thread of its
    own (torch's operators let go of the GIL), so that the parent tells a busy worker from a silent one."""
    while True:
        time.sleep(every_s)
        try:
            conn.send(("alive",))
        except (OSError, ValueError):  # the parent is gone, or the pipe closed
            return


class LastWord:
    """The last thing a worker was heard to do in its job (a phase it counted, a line it logged), for the row of a
    job stopped at its time-out or when it went silent."""

    def __init__(self) -> None:
        self.what, self.at, self.totals = "", 0.0, {}

    def heard(self, message: tuple) -> None:
        if message[0] == "split":
            grown = [k for k, v in message[1].items() if v > self.totals.get(k, 0.0)]
            self.totals = dict(message[1])
            if grown:
                self.what, self.at = f"it had counted time to {', '.join(grown)}", time.monotonic()
        elif message[0] == "log":
            self.what, self.at = f"it logged {message[3].splitlines()[0][:300]!r}", time.monotonic()
        elif message[0] == "finished":
            self.what, self.at = f"it had finished {len(message[1])} of the job's rows", time.monotonic()

    def text(self, now: float) -> str:
        if not self.what:
            return "nothing was heard of the job's progress (no phase counted, no line logged)"
        return f"last heard {now - self.at:.0f} s before: {self.what}"
