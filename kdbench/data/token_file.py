"""A token corpus a user names (``teacher.corpus``): a file of token ids, memory-mapped, never read whole.

Two forms: a NumPy ``.npy`` of integer ids (1-D, or 2-D read row after row: its rows joined), its dtype from its
header (:func:`numpy.load` with ``mmap_mode="r"``); or a raw binary of little-endian ``uint16`` or ``uint32`` ids,
as nanoGPT's ``train.bin`` (:class:`numpy.memmap`), its dtype given.  Only the ids a store needs are read
(:meth:`TokenFile.span`); :func:`scan_tokens` checks the first ``n`` a chunk at a time and returns their digest, a
sha256 of those ids as little-endian int64, so the same ids in a ``.npy`` and a ``.bin`` are the same corpus, and a
store is keyed by what it was built over, not by the file's name or container.  Every mistake raises
:class:`TokenFileError` in one line naming the file.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from kdbench.core.errors import KdbenchError

__all__ = ["TokenFile", "TokenFileError", "open_tokens", "scan_tokens", "windows_needed"]

RAW_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class TokenFileError(KdbenchError):
    """A token file that cannot be read as the corpus asked for (missing, empty, not integer ids, ...)."""


class TokenFile:
    """An opened token file: its ids as a read-only memory map (1-D or 2-D), how many there are, their dtype."""

    def __init__(self, path: Path, ids: np.ndarray):
        self.path, self.ids = path, ids
        self.tokens = int(ids.size)
        self.dtype = ids.dtype

    def span(self, start: int, stop: int) -> np.ndarray:
        """Ids ``start`` to ``stop`` (rows joined in order), int64: only the rows that hold them are read."""
        if self.ids.ndim == 1:
            return np.array(self.ids[start:stop], dtype=np.int64)
        width = self.ids.shape[1]
        first, last = start // width, math.ceil(stop / width)
        rows = np.array(self.ids[first:last], dtype=np.int64).reshape(-1)
        return rows[start - first * width : stop - first * width]


def open_tokens(path: str | Path, dtype: str | None = None) -> TokenFile:
    """The token file at ``path``, memory-mapped; ``dtype`` (uint16, uint32): a raw binary's ids (a ``.npy`` says its
    own: one given must agree)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise TokenFileError(f"token file {path} does not exist")
    if not path.is_file():
        raise TokenFileError(f"token file {path} is not a file")
    try:
        size = path.stat().st_size
        if size == 0:
            raise TokenFileError(f"token file {path} is empty (0 bytes)")
        if path.suffix == ".npy":
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            if dtype is None:
                raise TokenFileError(
                    f"token file {path} is a raw binary: give its id type, corpus: {{path: ..., dtype: uint16}} "
                    "(or uint32)"
                )
            raw = RAW_DTYPES[dtype]
            if size % raw.itemsize:
                raise TokenFileError(
                    f"token file {path} holds {size} bytes, not a whole number of {dtype} ids ({raw.itemsize} bytes "
                    "each): is it another dtype, or truncated?"
                )
            ids = np.memmap(path, dtype=raw, mode="r")
    except TokenFileError:
        raise
    except (OSError, ValueError) as exc:  # unreadable: permissions, a broken .npy header, an object array
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenFileError(f"token file {path} cannot be read: {why}") from None
    if not np.issubdtype(ids.dtype, np.integer):
        raise TokenFileError(f"token file {path} holds {ids.dtype} values, not integer token ids")
    if ids.ndim not in (1, 2):
        raise TokenFileError(
            f"token file {path} is {ids.ndim}-D ({'x'.join(map(str, ids.shape))}): give 1-D or 2-D ids"
        )
    if ids.size == 0:
        raise TokenFileError(f"token file {path} holds no ids")
    if path.suffix == ".npy" and dtype is not None and ids.dtype != RAW_DTYPES[dtype].newbyteorder("="):
        raise TokenFileError(
            f"token file {path} holds {ids.dtype} ids, not the {dtype} given: remove corpus.dtype (a .npy says its own)"
        )
    return TokenFile(path, ids)


def windows_needed(tokens: int, seq_len: int) -> tuple[int, int]:
    """(windows, ids read): the windows of ``seq_len + 1`` ids at a stride of ``seq_len`` that cover ``tokens``
    positions, and the ids they take (windows × seq_len + 1)."""
    n = max(1, math.ceil(tokens / seq_len))
    return n, n * seq_len + 1


CHUNK = 1 << 22  # ids a scan reads at a time (32 MiB as int64)


def scan_tokens(file: TokenFile, n: int, vocab: int | None = None) -> str:
    """The first ``n`` ids checked (none negative, none at or beyond ``vocab``), read a chunk at a time; returns
    their digest: a sha256 of the ids as little-endian int64, 16 hex digits."""
    h, low, high = hashlib.sha256(), 0, -1
    for start in range(0, n, CHUNK):
        ids = file.span(start, min(n, start + CHUNK))
        low, high = min(low, int(ids.min())), max(high, int(ids.max()))
        h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    if low < 0:
        raise TokenFileError(f"token file {file.path} holds a negative id ({low}) in its first {n} ids")
    if vocab is not None and high >= vocab:
        raise TokenFileError(
            f"token file {file.path} holds id {high} in its first {n} ids, beyond the pair's vocabulary of {vocab} "
            f"(ids 0..{vocab - 1}): was it tokenized for another model?"
        )
    return h.hexdigest()[:16]
