"""An offline teacher store on disk: a folder of shards and the JSON manifest that names and checks them.

``manifest.json`` holds the store's key (the teacher's digest, the tokenizer's, a token file's digest where the
corpus is one, the vocabulary, the sequence length, k, top-p, the temperature, the encoding:
:mod:`kdbench.store.teacher_logits`), the build's figures and one entry per finished shard: its file, tokens, bytes
on disk, raw bytes and sha256, and its tokens' file (int32 windows of ``seq_len + 1`` ids: a sequence and its
next-token labels) and that file's sha256.

Writes are atomic: a shard (and its tokens' file) is written under a hidden temporary name and renamed into place
(``os.replace``), then the manifest is rewritten the same way; a shard is finished once the manifest lists it.  A
killed build leaves the shards the manifest lists, and the next build keeps them untouched (it resumes at the first
one missing); a full disk (or any ``OSError``) while writing one stops the build in one line, the finished shards
and the manifest intact.

Reads check: a store whose key differs from the cell's is refused in one line naming what differs (a changed teacher
is never read as the old one); a shard whose size or sha256 is not the manifest's is refused in one line naming the
shard.  A reader takes any rows of an uncompressed shard with positioned reads (``os.pread``): no mapping pins the
pages, so ``drop_pages`` (``posix_fadvise(DONTNEED)``, where the OS has it) makes the next read cold.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kdbench.core.errors import KdbenchError
from kdbench.store.files import write_atomic
from kdbench.store.teacher_logits import (
    Encoding,
    compress,
    decode,
    decode_sections,
    decompress,
    encode,
    section_offsets,
)

MANIFEST = "manifest.json"
FORMAT = "kdbench-teacher-topk/1"
KEY_NAMES = ("teacher", "tokenizer", "corpus", "vocab", "seq_len", "k", "top_p", "temperature", "encoding")
TOKEN_ID_BYTES = 4  # the token ids beside the top-k: int32, windows of seq_len + 1 (a sequence and its labels)


def token_id_bytes(tokens: int, seq_len: int) -> int:
    """The token ids a store keeps beside its top-k for ``tokens`` tokens: whole sequences of ``seq_len + 1`` int32
    ids (what ``kdbench fit`` and the report's offline section print beside the top-k's bytes)."""
    return math.ceil(tokens / seq_len) * (seq_len + 1) * TOKEN_ID_BYTES


def store_key(
    teacher: str,
    tokenizer: str,
    vocab: int,
    seq_len: int,
    temperature: float,
    encoding: Encoding,
    corpus: str | None = None,
) -> dict:
    """What a store is built from; a reader refuses a store whose key is not its own.  ``corpus``: a token file's
    digest (and name); None, the stdlib text, is left out of the key (the keys of stores built before it)."""
    return {
        **({"corpus": corpus} if corpus is not None else {}),
        "teacher": teacher,
        "tokenizer": tokenizer,
        "vocab": vocab,
        "seq_len": seq_len,
        "k": encoding.k,
        "top_p": encoding.top_p,
        "temperature": temperature,
        "encoding": f"{encoding.values} {encoding.indices} {encoding.compression}",
    }


def key_digest(key: dict) -> str:
    """A short name for a store's key (the folder a run keeps its store in)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def key_difference(path: Path, built: dict, wanted: dict) -> str | None:
    """One line naming what differs between the store's key and the cell's; None when they agree."""

    def shown(key: dict, n: str) -> str:
        return "the stdlib text" if n == "corpus" and key.get(n) is None else repr(key.get(n))

    diffs = [
        f"{n} {shown(built, n)} (this cell's: {shown(wanted, n)})" for n in KEY_NAMES if built.get(n) != wanted.get(n)
    ]
    if not diffs:
        return None
    return (
        f"teacher store {path} was built with another {', '.join(d.split(' ')[0] for d in diffs)}: "
        f"{'; '.join(diffs)}; point teacher.store at another folder, or delete this one to rebuild it"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@dataclass
class Shard:
    index: int
    file: str
    tokens_file: str
    sequences: int
    tokens: int  # positions with a stored top-k: sequences × seq_len
    bytes: int  # on disk
    raw_bytes: int  # before compression
    sha256: str
    tokens_sha256: str


class LogitStore:
    """A store folder: its manifest, its shards, and the writes and reads of both."""

    def __init__(self, path: str | Path, key: dict, encoding: Encoding, write: Callable[[Path, bytes], None] | None):
        self.path = Path(path)
        self.key = key
        self.encoding = encoding
        self._write = write or _write_bytes  # the tests hand a writer that fails (a full disk)
        self.shards: dict[int, Shard] = {}
        self.info: dict = {}  # the build's figures (tokens/s, reconstruction KL, ...)
        self._verified: set[int] = set()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        path: str | Path,
        key: dict,
        encoding: Encoding,
        create: bool = False,
        write: Callable[[Path, bytes], None] | None = None,
    ) -> LogitStore:
        """The store at ``path`` built with ``key`` (``create``: an empty one where there is none); another key,
        or no store where one is read, raises KdbenchError in one line."""
        store = cls(path, key, encoding, write)
        manifest = store.path / MANIFEST
        if not manifest.is_file():
            if not create:
                raise KdbenchError(f"teacher store {store.path}: no {MANIFEST} there; build it first (teacher.store)")
            store.path.mkdir(parents=True, exist_ok=True)
            store._save()
            return store
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            built = data["key"]
        except (OSError, ValueError, KeyError, TypeError):
            raise KdbenchError(
                f"teacher store {store.path}: {MANIFEST} is not a teacher store's manifest; delete the folder"
            ) from None
        if data.get("format") != FORMAT:
            raise KdbenchError(f"teacher store {store.path} is format {data.get('format')!r}, not {FORMAT}")
        why = key_difference(store.path, built, key)
        if why:
            raise KdbenchError(why)
        store.shards = {s["index"]: Shard(**s) for s in data.get("shards", [])}
        store.info = data.get("info", {})
        return store

    def _save(self) -> None:
        data = {
            "format": FORMAT,
            "key": self.key,
            "encoding": self.encoding.as_dict(),
            "bytes_per_token": self.encoding.bytes_per_token,
            "info": self.info,
            "shards": [vars(s) for _, s in sorted(self.shards.items())],
        }
        text = json.dumps(data, indent=1, sort_keys=True)
        write_atomic(self.path / MANIFEST, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    # ------------------------------------------------------------------ writing

    def finished(self, index: int) -> bool:
        """Whether shard ``index`` is listed and its files are there at their sizes (a resumed build skips it)."""
        s = self.shards.get(index)
        if s is None:
            return False
        f, t = self.path / s.file, self.path / s.tokens_file
        return f.is_file() and f.stat().st_size == s.bytes and t.is_file()

    def write_shard(
        self, index: int, tokens: np.ndarray, logp: np.ndarray, indices: np.ndarray, rest: np.ndarray
    ) -> Shard:
        """Encode and write shard ``index``: ``tokens`` (m, seq_len + 1), the top-k of its m × seq_len positions
        (``logp`` float32 (n, k) descending, ``indices``, ``rest``); atomic, then listed in the manifest."""
        raw = encode(self.encoding, logp, indices, rest)
        data = compress(self.encoding, raw)
        ids = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        name, tokens_name = f"shard-{index:05d}.bin", f"tokens-{index:05d}.bin"
        try:
            write_atomic(self.path / tokens_name, lambda tmp: self._write(Path(tmp), ids))
            write_atomic(self.path / name, lambda tmp: self._write(Path(tmp), data))
        except OSError as exc:
            reason = (exc.strerror or type(exc).__name__).lower()
            raise KdbenchError(
                f"teacher store {self.path}: writing {name} failed ({reason}); the {len(self.shards)} finished "
                "shard(s) are intact and a rerun resumes after them: free space, or point teacher.store elsewhere"
            ) from None
        shard = Shard(
            index,
            name,
            tokens_name,
            int(tokens.shape[0]),
            int(logp.shape[0]),
            len(data),
            len(raw),
            hashlib.sha256(data).hexdigest(),
            hashlib.sha256(ids).hexdigest(),
        )
        self.shards[index] = shard
        self._save()
        return shard

    def set_info(self, **info) -> None:
        self.info.update(info)
        self._save()

    # ------------------------------------------------------------------ reading

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards.values())

    @property
    def sequences(self) -> int:
        return sum(s.sequences for s in self.shards.values())

    @property
    def disk_bytes(self) -> int:
        return sum(s.bytes for s in self.shards.values())

    def shard_files(self) -> list[Path]:
        return [self.path / s.file for _, s in sorted(self.shards.items())]

    def verify(self, index: int) -> None:
        """Refuse shard ``index`` in one line naming it when its files' sizes or sha256 are not the manifest's."""
        s = self.shards[index]
        for name, digest, size in ((s.file, s.sha256, s.bytes), (s.tokens_file, s.tokens_sha256, None)):
            f = self.path / name
            if not f.is_file():
                raise KdbenchError(f"teacher store {self.path}: shard file {name} is missing; delete it to rebuild")
            actual = f.stat().st_size
            if size is not None and actual != size:
                raise KdbenchError(
                    f"teacher store {self.path}: shard {name} is {actual} bytes, the manifest says {size} "
                    "(truncated?); delete it and rerun the build to rewrite it"
                )
            if _sha256(f) != digest:
                raise KdbenchError(
                    f"teacher store {self.path}: shard {name} fails its sha256 checksum (corrupted); delete it and "
                    "rerun the build to rewrite it"
                )
        self._verified.add(index)

    def read(self, index: int, start: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sequences ``start .. start + m`` of shard ``index``: (tokens (m, seq_len + 1) int32, logp, indices, rest),
        the top-k rows of their m × seq_len positions (:func:`~kdbench.store.teacher_logits.decode_sections`).  A
        shard is checked (:meth:`verify`) the first time this store reads it."""
        if index not in self._verified:
            self.verify(index)
        s, seq_len = self.shards[index], int(self.key["seq_len"])
        row0, rows = start * seq_len, m * seq_len
        with open(self.path / s.tokens_file, "rb") as f:
            width = 4 * (seq_len + 1)
            ids = os.pread(f.fileno(), m * width, start * width)
        tokens = np.frombuffer(ids, dtype=np.int32).reshape(m, seq_len + 1)
        if self.encoding.compression != "none":  # a compressed shard is read and decompressed whole
            data = decompress(self.encoding, (self.path / s.file).read_bytes(), s.raw_bytes)
            return (tokens, *decode(self.encoding, data, s.tokens, row0, rows))
        sections = {}
        with open(self.path / s.file, "rb") as f:
            for name, (offset, per_row) in section_offsets(self.encoding, s.tokens).items():
                sections[name] = os.pread(f.fileno(), rows * per_row, offset + row0 * per_row)
        return (tokens, *decode_sections(self.encoding, sections, rows))


def drop_pages(paths: list[Path]) -> bool:
    """Ask the OS to drop ``paths``' pages from its page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), so the next
    read comes from the disk; False where the OS has no such call (the reads then stay warm)."""
    advise = getattr(os, "posix_fadvise", None)
    flag = getattr(os, "POSIX_FADV_DONTNEED", None)
    if advise is None or flag is None:
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            try:
                os.fdatasync(fd)  # dirty pages are not dropped: write them back first
            except (OSError, AttributeError):
                pass
            advise(fd, 0, 0, flag)
        finally:
            os.close(fd)
    return True
