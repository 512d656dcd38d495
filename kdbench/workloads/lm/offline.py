"""``teacher: {mode: offline}``: the teacher's top-k next-token log-probabilities written once for a token corpus to
a store on disk (:mod:`kdbench.store.logit_store`), and a step that reads them ahead on a background thread.

The build (:func:`build_store`).  The corpus is the standard library's text in bytes (:mod:`kdbench.data.corpus`),
or the token file ``teacher.corpus`` names (:mod:`kdbench.data.token_file`, memory-mapped, read a shard's windows at
a time: :class:`FileWindows`), in windows of ``data.seq_len + 1`` tokens at a stride of ``seq_len`` (a sequence and
its next-token labels), the first ``teacher.store_tokens`` of it; the teacher runs over it ``batch_size`` sequences
at a time, in the cell's teacher precision, and each shard's top-k at the loss's temperature
(:func:`kdbench.distill.lm.topk.topk_rows`, the same as the in-memory ``topk_cache``'s) is encoded and written
atomically.  Two clocks, host time between synchronisations: the teacher's forward with its LM head (the logits),
and the encode + write (log-softmax, top-k, encoding, compression, checksum, the atomic writes).  A build cut short
resumes after its finished shards; its progress is logged shard by shard.  What the encoding loses
(``topk_reconstruction_kl``: the dense distribution against the decoded entries' reconstruction) is measured on the
first :data:`DIAG_TOKENS` tokens, outside both clocks.

The key.  A store is keyed by the teacher's digest (a sha256 of its parameters as the step holds them: the registry
builds them from the config and the cell's seed, so a changed config, seed or weights dtype is another teacher),
the tokenizer's (bytes), a token file's digest (of the ids read), the vocabulary, ``seq_len``, k, top-p, the
temperature and the encoding; a store with another key is refused in one line naming what differs.

The read (:class:`Prefetcher`).  A thread reads the next batches (``PREFETCH`` ahead) while the step trains: the
batch's sequences, their top-k rows (positioned reads of an uncompressed shard; a compressed one read whole), decoded
and copied to the step's device.  The step's ``teacher_read`` phase is how long it waited for the next batch (≈0
when the read hides behind the step); the row also has what a read took on the thread (``teacher_read_ms``) and its
tokens/s.  With ``page_cache: cold`` each read first drops its shard's pages (``posix_fadvise(DONTNEED)``).

Data-parallel cells (``world_size`` > 1, DDP).  Rank 0 builds the store while the others wait at a barrier, then
open it under the same key; each rank reads its own batches (step b of the ranks: ``world_size`` consecutive
batches of the store, rank r the r-th).
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.names import IGNORE_INDEX
from kdbench.data.corpus import join_files, stdlib_files, stdlib_root
from kdbench.data.text import windows
from kdbench.data.token_file import TokenFile, TokenFileError, open_tokens, scan_tokens, windows_needed
from kdbench.data.tokenizers import ByteTokenizer, digest
from kdbench.data.tokens import prompt_length
from kdbench.distill.lm.topk import TopKTeacher, reconstruction_kl, topk_rows
from kdbench.store.logit_store import LogitStore, drop_pages, key_digest, store_key
from kdbench.store.teacher_logits import Encoding, decode, encode, resolve_indices
from kdbench.workloads.lm.checks import store_tokens_beyond

logger = logging.getLogger(__name__)

SHARD_TOKENS = 8192  # positions per shard (whole sequences, at least one)
DIAG_TOKENS = 4096  # positions the build's reconstruction KL is measured on
PREFETCH = 2  # batches the reader keeps ready
STORES_DIR = "teacher-stores"  # under the run's folder: the stores of cells that name none
CORPUS_IDS = "the corpus file's ids"  # a token file's store: its tokenizer is the file's (its digest is the corpus's)


def teacher_digest(model: torch.nn.Module) -> str:
    """A sha256 of the teacher's parameters and buffers (names, dtypes, shapes, bytes), 16 hex digits."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def corpus_windows(seq_len: int, tokens: int) -> torch.Tensor:
    """(N, seq_len + 1) int64 byte ids: the stdlib corpus's first ceil(tokens / seq_len) windows."""
    n = max(1, math.ceil(tokens / seq_len))
    blob, _ = join_files(stdlib_root(), stdlib_files(), n * seq_len + 1)
    x, y = windows(blob, seq_len)
    if x.shape[0] < n:
        raise KdbenchError(f"teacher.store_tokens {tokens}: the stdlib corpus holds {x.shape[0] * seq_len}; lower it")
    return torch.cat([x, y[:, -1:]], dim=1)


class FileWindows:
    """(N, seq_len + 1) int64 windows of a token file's first N × seq_len + 1 ids at a stride of seq_len, read a
    slice at a time from its memory map (a store's build reads one shard's windows at once)."""

    def __init__(self, file: TokenFile, seq_len: int, n: int):
        self.file, self.seq_len = file, seq_len
        self.shape = (n, seq_len + 1)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.shape[0])
        ids = torch.from_numpy(self.file.span(start * self.seq_len, stop * self.seq_len + 1))
        return ids.unfold(0, self.seq_len + 1, self.seq_len)


def corpus_of(config: CellConfig, vocab: int | None = None) -> tuple[Any, str | None]:
    """The store's windows and its corpus's part of the key: the stdlib text's (None), or ``teacher.corpus``'s
    (``sha256:<digest> of <n> ids``, the digest of the ids read, :func:`kdbench.data.token_file.scan_tokens`: the
    same ids in another file or container are the same corpus), its ids checked against ``vocab``."""
    t, seq_len = config.teacher, config.data.seq_len
    if t.corpus is None:
        return corpus_windows(seq_len, t.store_tokens), None
    file = open_tokens(t.corpus.path, t.corpus.dtype)
    n, need = windows_needed(t.store_tokens, seq_len)
    if (why := store_tokens_beyond(config, file)) is not None:
        raise TokenFileError(why)
    return FileWindows(file, seq_len, n), f"sha256:{scan_tokens(file, need, vocab)} of {need} ids"


def encoding_of(config: CellConfig, vocab: int) -> Encoding:
    t = config.teacher
    return Encoding(min(t.k, vocab), t.values, resolve_indices(t.indices, vocab), t.compression, t.top_p)


def store_path(config: CellConfig, key: dict, run_dir: str | None) -> Path:
    """``teacher.store`` (relative: under the run's folder), else teacher-stores/<the key's digest> there (no run:
    the system's temporary folder)."""
    root = Path(run_dir) if run_dir else Path(tempfile.gettempdir()) / "kdbench"
    if config.teacher.store is None:
        return root / STORES_DIR / key_digest(key)
    given = Path(config.teacher.store).expanduser()
    return given if given.is_absolute() or not run_dir else root / given


def open_store(
    distiller: Any,
    config: CellConfig,
    run_dir: str | None,
    create: bool = True,
    path: Path | None = None,
    corpus: str | None = None,
) -> LogitStore:
    """The cell's store (made empty where there is none; at ``path`` if given), its key from the distiller's teacher
    and loss, and ``corpus`` (a token file's digest; None: the stdlib text, in bytes)."""
    loss = distiller.loss_fn
    enc = encoding_of(config, loss.vocab)
    tokenizer = digest(ByteTokenizer()) if corpus is None else CORPUS_IDS
    key = store_key(
        teacher_digest(distiller.teacher),
        tokenizer,
        loss.vocab,
        config.data.seq_len,
        loss.token.temperature,
        enc,
        corpus=corpus,
    )
    return LogitStore.open(path or store_path(config, key, run_dir), key, enc, create=create)


def sequences_per_shard(seq_len: int) -> int:
    """Whole sequences a shard holds (:data:`SHARD_TOKENS` positions, at least one sequence)."""
    return max(1, SHARD_TOKENS // seq_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_store(distiller: Any, store: LogitStore, seqs: torch.Tensor, batch_size: int) -> dict:
    """Write the shards of ``seqs`` ((N, seq_len + 1) ids) that ``store`` lacks; returns the store's build figures
    (``store.info``: totals over every build session that wrote to it)."""
    loss = distiller.loss_fn
    seq_len = seqs.shape[1] - 1
    per_shard = sequences_per_shard(seq_len)
    shards = math.ceil(seqs.shape[0] / per_shard)
    device = distiller.fixed_input.device
    info = {"forward_s": 0.0, "encode_write_s": 0.0, "built_tokens": 0, "kl_sum": 0.0, "kl_tokens": 0, **store.info}
    todo = [i for i in range(shards) if not store.finished(i)]
    for done, i in enumerate(todo):
        chunk = seqs[i * per_shard : (i + 1) * per_shard]
        parts = []
        forward_s = encode_s = 0.0
        for b in range(0, chunk.shape[0], batch_size):
            x = chunk[b : b + batch_size, :-1].to(device)
            _sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                logits = loss.teacher.logits(distiller.teacher_outputs(x).logits, loss.dtypes[0], loss.vocab)
            _sync(device)
            mid = time.perf_counter()
            top, idx, rest = topk_rows(logits, store.encoding.k, loss.token.temperature)
            parts.append((top.cpu().numpy(), idx.cpu().numpy(), rest.cpu().numpy()))
            forward_s, encode_s = forward_s + mid - start, encode_s + time.perf_counter() - mid
            if info["kl_tokens"] < DIAG_TOKENS:  # what the encoding loses, outside the clocks
                info["kl_sum"] += _encoded_kl(store.encoding, logits, *parts[-1], loss) * top.shape[0]
                info["kl_tokens"] += top.shape[0]
        start = time.perf_counter()
        top, idx, rest = (np.concatenate(p) for p in zip(*parts))
        store.write_shard(i, chunk.numpy(), top, idx, rest)
        encode_s += time.perf_counter() - start
        info["forward_s"] += forward_s
        info["encode_write_s"] += encode_s
        info["built_tokens"] += top.shape[0]
        store.set_info(**info)
        logger.info(
            "teacher store %s: shard %d/%d written (%d of %d to build this time, %.0f tokens/s)",
            store.path,
            i + 1,
            shards,
            done + 1,
            len(todo),
            top.shape[0] / max(forward_s + encode_s, 1e-9),
        )
    return store.info


def _encoded_kl(enc: Encoding, logits: torch.Tensor, top, idx, rest, loss: Any) -> float:
    """KL of the dense distribution against the reconstruction of its encoded, decoded top-k."""
    logp, ids, r = decode(enc, encode(enc, top, idx, rest), top.shape[0])
    cache = to_topk(logp, ids, r, enc, loss.vocab, loss.token.temperature, logits.device)
    return reconstruction_kl(logits.reshape(-1, logits.shape[-1]), cache)


def to_topk(logp, ids, rest, enc: Encoding, vocab: int, temperature: float, device, shape=None) -> TopKTeacher:
    """Decoded arrays as the sparse KL's :class:`TopKTeacher` (``shape``: the leading dims, else (n,))."""
    values = torch.from_numpy(np.array(logp))
    if enc.values == "bf16":
        values = values.view(torch.bfloat16)
    shape = tuple(shape) if shape is not None else (values.shape[0],)
    return TopKTeacher(
        values.reshape(*shape, enc.k).to(device),
        torch.from_numpy(np.array(ids)).reshape(*shape, enc.k).to(device),
        torch.from_numpy(np.array(rest)).reshape(shape).to(device),
        vocab,
        temperature,
    )


class Prefetcher:
    """The step's batches from a store, read ``depth`` ahead by a background thread: ``next()`` returns
    (x, y, top-k) and records how long the caller waited; the thread records what each read took."""

    def __init__(
        self,
        store: LogitStore,
        batch_size: int,
        prompt: int,
        device: torch.device,
        temperature: float,
        vocab: int,
        sequences: int | None = None,
        cold: bool = False,
        depth: int = PREFETCH,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.store, self.batch_size, self.prompt, self.device = store, batch_size, prompt, device
        self.rank, self.world_size = rank, world_size
        self.temperature, self.vocab = temperature, vocab
        self.cold = cold and drop_pages([])  # False where the OS cannot drop pages
        self.cold_asked = cold
        order = [(i, j) for i, s in sorted(store.shards.items()) for j in range(s.sequences)]
        self.order = order[:sequences] if sequences else order
        if len(self.order) < batch_size * world_size:
            ranks = f" × world_size {world_size}" if world_size > 1 else ""
            raise KdbenchError(
                f"teacher store {store.path} holds {len(self.order)} sequences, fewer than batch_size {batch_size}"
                f"{ranks}; raise teacher.store_tokens"
            )
        self.waits_ms: list[float] = []
        self.reads_ms: list[float] = []
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kdbench-teacher-read", daemon=True)
        self._thread.start()

    def _pieces(self, b: int) -> list[tuple[int, int, int]]:
        """(shard, first sequence, count) runs of this rank's batch ``b``'s sequences, the order wrapping around: step
        ``b`` of the ranks reads ``world_size`` consecutive batches, rank r the r-th (as a distributed sampler)."""
        first = (b * self.world_size + self.rank) * self.batch_size
        picks = [self.order[(first + n) % len(self.order)] for n in range(self.batch_size)]
        runs: list[list[int]] = []
        for shard, seq in picks:
            if runs and runs[-1][0] == shard and runs[-1][1] + runs[-1][2] == seq:
                runs[-1][2] += 1
            else:
                runs.append([shard, seq, 1])
        return [tuple(r) for r in runs]  # type: ignore[misc]

    def read(self, b: int) -> tuple[torch.Tensor, torch.Tensor, TopKTeacher]:
        """Batch ``b``: read, decoded, on the device."""
        pieces = self._pieces(b)
        if self.cold:
            drop_pages([self.store.path / self.store.shards[s].file for s, _, _ in pieces])
        parts = [self.store.read(s, start, m) for s, start, m in pieces]
        tokens, logp, ids, rest = (np.concatenate(p) for p in zip(*parts))
        seq_len = tokens.shape[1] - 1
        ids_t = torch.from_numpy(tokens.astype(np.int64))
        x, y = ids_t[:, :-1].contiguous(), ids_t[:, 1:].clone()
        y[:, : self.prompt] = IGNORE_INDEX
        cache = to_topk(logp, ids, rest, self.store.encoding, self.vocab, self.temperature, self.device)
        cache = TopKTeacher(
            cache.logp.reshape(self.batch_size, seq_len, -1),
            cache.indices.reshape(self.batch_size, seq_len, -1),
            cache.log_rest.reshape(self.batch_size, seq_len),
            self.vocab,
            self.temperature,
        )
        return x.to(self.device), y.to(self.device), cache

    def _run(self) -> None:
        b = 0
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                item: Any = self.read(b)
            except BaseException as exc:  # handed to the step, which raises it
                item = exc
            read_ms = (time.perf_counter() - start) * 1e3
            while not self._stop.is_set():
                try:
                    self._queue.put((item, read_ms), timeout=0.05)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            b += 1

    def next(self) -> tuple[torch.Tensor, torch.Tensor, TopKTeacher]:
        start = time.perf_counter()
        item, read_ms = self._queue.get()
        self.waits_ms.append((time.perf_counter() - start) * 1e3)
        if isinstance(item, BaseException):
            raise item
        self.reads_ms.append(read_ms)
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        while not self._queue.empty():
            self._queue.get_nowait()

    def columns(self, tokens_per_batch: int) -> dict:
        read = statistics.median(self.reads_ms) if self.reads_ms else None
        if not self.cold_asked:
            cache = "warm"
        else:
            cache = "cold" if self.cold else "warm (this OS cannot drop a file's pages: no posix_fadvise)"
        return {
            "teacher_read_ms": read,
            "teacher_read_wait_ms": statistics.median(self.waits_ms) if self.waits_ms else None,
            "teacher_read_tokens_per_s": tokens_per_batch / (read / 1e3) if read else None,
            "teacher_store_page_cache": cache,
        }


class OfflineTeacher:
    """What a ``teacher.mode: offline`` step reads its batches from: the store (built or resumed first) and its
    prefetching reader; the row's store columns."""

    def __init__(self, distiller: Any, config: CellConfig, run_dir: str | None, dp: Any = None):
        loss = distiller.loss_fn
        seqs, corpus = corpus_of(config, loss.vocab)
        ranks = dp is not None and dp.world_size > 1
        if not ranks or dp.root:  # a data-parallel cell's store is built by rank 0 alone, the others waiting
            self.store = open_store(distiller, config, run_dir, corpus=corpus)
            self.build = build_store(distiller, self.store, seqs, config.batch_size)
        if ranks:
            dp.barrier()
            if not dp.root:  # the store rank 0 built, under the same key (the same teacher, corpus and encoding)
                self.store = open_store(distiller, config, run_dir, create=False, corpus=corpus)
                self.build = self.store.info
        self.tokens_per_batch = config.batch_size * config.data.seq_len
        device = distiller.fixed_input.device
        self.reader = Prefetcher(
            self.store,
            config.batch_size,
            prompt_length(config),
            device,
            loss.token.temperature,
            loss.vocab,
            sequences=seqs.shape[0],
            cold=config.teacher.page_cache == "cold",
            rank=dp.rank if ranks else 0,
            world_size=dp.world_size if ranks else 1,
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, TopKTeacher]:
        return self.reader.next()

    def close(self) -> None:
        self.reader.close()

    def columns(self) -> dict:
        info, store = self.build, self.store
        built = info.get("built_tokens") or 0
        forward, encode_write = info.get("forward_s") or 0.0, info.get("encode_write_s") or 0.0
        return {
            "teacher_store_encoding": store.encoding.label,
            "teacher_store_tokens": store.tokens,
            "teacher_store_bytes_per_token": store.disk_bytes / store.tokens if store.tokens else None,
            "teacher_store_build_s": forward + encode_write if built else None,
            "teacher_store_forward_tokens_per_s": built / forward if forward else None,
            "teacher_store_encode_tokens_per_s": built / encode_write if encode_write else None,
            "topk_reconstruction_kl": info["kl_sum"] / info["kl_tokens"] if info.get("kl_tokens") else None,
            **self.reader.columns(self.tokens_per_batch),
        }


VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32}  # as decoded on the device


class FakeOfflineTeacher:
    """A fit's fake run of an offline step (:mod:`kdbench.fit`): nothing read, the decoded top-k buffers made on the
    device as the reader makes them, ``PREFETCH`` batches ready besides the step's (what the teacher costs the
    device: its read buffers); the fixed batch's tokens (their labels carry the values the loss needs)."""

    def __init__(self, distiller: Any, config: CellConfig):
        loss = distiller.loss_fn
        self.vocab, self.temperature = loss.vocab, loss.token.temperature
        self.enc = encoding_of(config, loss.vocab)
        self.ready: list[TopKTeacher] = []

    def _batch(self, x: torch.Tensor) -> TopKTeacher:
        shape, k = tuple(x.shape), self.enc.k
        return TopKTeacher(
            torch.empty(*shape, k, dtype=VALUE_DTYPES[self.enc.values], device=x.device),
            torch.empty(*shape, k, dtype=torch.int32, device=x.device),
            torch.empty(*shape, dtype=torch.float32, device=x.device),
            self.vocab,
            self.temperature,
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, TopKTeacher]:
        while len(self.ready) < PREFETCH + 1:
            self.ready.append(self._batch(x))
        cache = self.ready.pop(0)
        return x, y, cache

    def close(self) -> None:
        self.ready.clear()

    def columns(self) -> dict:
        return {}
