"""What a process kdbench starts does for itself: die with its parent."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (even by kill -9)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
