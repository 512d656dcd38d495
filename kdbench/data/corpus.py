"""The text corpus kdbench reads: the standard library's own ``.py`` source of the Python running kdbench (on
every machine, nothing downloaded), listed and joined byte for byte.  The text quality protocol
(:mod:`kdbench.quality.text`) trains and evaluates on it; cross-tokenizer LM cells
(:mod:`kdbench.workloads.lm.xtok`) take their batches' text from it and train their BPE tokenizers on it."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = ["SKIP_DIRS", "join_files", "stdlib_files", "stdlib_root"]

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """The corpus's files: paths relative to ``root`` (the stdlib), in POSIX form, sorted."""
    root = stdlib_root() if root is None else Path(root)
    out = []
    for folder, dirs, files in os.walk(root):  # symbolic links to folders are not followed
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-")]
        rel = Path(folder).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(out)


def join_files(root: Path, files: list[str], cap: int | None) -> tuple[bytes, int]:
    """The files' bytes joined in order, cut at ``cap``, and how many files that used."""
    chunks, n, used = [], 0, 0
    for f in files:
        if cap is not None and n >= cap:
            break
        data = (root / f).read_bytes()
        chunks.append(data)
        n += len(data)
        used += 1
    blob = b"".join(chunks)
    return (blob if cap is None else blob[:cap]), used
