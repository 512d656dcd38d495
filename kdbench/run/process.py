"""What a process kdbench starts does for itself: die with its parent; and how it is started: deaf to Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


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
