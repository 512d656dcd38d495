"""Atomic files: a file appears whole or not at all.

Everything kdbench stores is written under a hidden temporary name in the target
folder and renamed into place (``os.replace`` is atomic on POSIX), so a reader, or a
run killed at any moment, never sees half a file.  Hidden names (``.x.tmp``) are
skipped by kdbench's readers, by pyarrow datasets and by ``*.parquet`` globs.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kdbench.core.errors import KdbenchError

_UMASK = os.umask(0o022)  # read once, at import (os.umask can only be read by setting it)
os.umask(_UMASK)


def make_folder(path: Path, what: str) -> Path:
    """Make the folder ``path`` (and its parents), or say in one line why it cannot be made (a file on its path, no
    permission, a file system that refuses: /proc), naming ``what`` the user gave (``--out``), not a traceback."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise KdbenchError(
            f"{what} {path}: cannot make the folder: {reason.lower()}; give a folder you can write"
        ) from None
    return path


def write_atomic(path: Path, write) -> Path:
    """Call ``write(tmp_path)`` on a hidden temporary in ``path``'s folder, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # as open() would have made it (mkstemp makes 0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_parquet(table: pa.Table, path: Path) -> Path:
    """Write ``table`` to ``path`` atomically."""
    return write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def write_text(text: str, path: Path) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
