"""Quality on real text for language-model pairs: the standard library's own source, byte by byte.

``quality: {dataset: python-stdlib, ...}`` trains the suite's LM pairs on the ``.py`` files of the
running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``): real text that ships
with every Python, so nothing is downloaded.

The corpus.  Every ``.py`` file under the stdlib folder, but those of ``site-packages`` /
``dist-packages`` (what is installed, not what ships), of test folders (``test``, ``tests``,
``idle_test``: distributions often leave them out) and the build's own configuration
(``config-*`` folders, ``_sysconfigdata*``), sorted by path.  The files are shuffled with a
generator seeded by the split seed and the first ``round(test_fraction x files)`` are held out,
whole: no held-out file is ever seen in training.  Each split's files are joined in that order
and cut at its share of ``max_bytes`` (``test_fraction`` of it held out).  The tokens are the
bytes (vocabulary 256), in windows of ``seq_len + 1`` bytes at a stride of ``seq_len``: the model
reads the first ``seq_len`` and predicts each next one, so every byte of a split but its first is
predicted once.  Given the Python version (the rows' ``python_version``) and the seed, the
corpus is the same; ``quality_corpus`` on each row names it, with a hash of its bytes.

The protocol is :mod:`kdbench.quality.protocol`'s (:class:`TextRun` is its run,
:class:`kdbench.quality.train.QualityRun`, with the language-model parts): per seed the teacher
trains with next-byte cross-entropy, each distinct student from scratch, and each student distilled
from that seed's teacher by each of the suite's LM methods through ``Distiller.train_step``, one
recipe, one batch order per seed.  The models are
built with ``vocab_size: 256`` laid over the cells' ``overrides`` (forced, as the image protocol
sets the classifiers' classes to the data set's); a ``module:callable`` must have 256 outputs.

Each row records the held-out **perplexity** (exp of the mean next-byte cross-entropy in nats over
every held-out byte predicted) and ``bits_per_byte`` after the last epoch, the perplexity after
every epoch against the training time by then, next-byte top-1 ``accuracy``, ``agreement`` with the
teacher's next-byte argmax, and the time to quality: the training time until the perplexity is at
most the seed's teacher's / ``target``.  With ``quality.speculative`` each student's row also records it as the
draft of its seed's teacher in speculative decoding (:mod:`kdbench.quality.drafts`): the run keeps each student's
model until its row is filled (and rebuilds it from its checkpoint on a resume, as it does teachers).
"""

from __future__ import annotations

import hashlib
import logging
import math
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kdbench.config.schema import CellConfig, QualityConfig
from kdbench.errors import KdbenchError
from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast
from kdbench.hw.corpus import join_files, stdlib_files, stdlib_root
from kdbench.measure.failures import error_text
from kdbench.models.hub import is_callable_name
from kdbench.names import IGNORE_INDEX
from kdbench.quality.checkpoints import Checkpoints
from kdbench.quality.drafts import DRAFT_ROW_KEYS, measure_draft
from kdbench.quality.drafts import describe as describe_draft
from kdbench.quality.train import DeviceData, QualityRun, Trained, ce_step, fit, init_seed

_join = join_files  # the corpus's reading lives in kdbench.hw.corpus (cross-tokenizer LM cells read it too)
BYTES = 256  # the vocabulary: one token per byte value
EVAL_TOKENS = 1 << 15  # held-out tokens per evaluation forward
logger = logging.getLogger(__name__)


def split_files(files: list[str], test_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, held-out) files: shuffled by a generator seeded with ``seed``, the first share held out."""
    if len(files) < 2:
        raise KdbenchError(f"quality: the corpus has {len(files)} file(s); the split by file needs at least 2")
    order = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    n_test = min(len(files) - 1, max(1, round(test_fraction * len(files))))
    return order[n_test:], order[:n_test]


def windows(blob: bytes, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte labels, int64 (N, seq_len): windows of seq_len + 1 bytes at a stride of seq_len."""
    n = (len(blob) - 1) // seq_len
    if n < 1:
        raise KdbenchError(
            f"quality: {len(blob)} bytes make no window of seq_len + 1 = {seq_len + 1}; raise max_bytes or "
            "lower seq_len"
        )
    data = torch.frombuffer(bytearray(blob[: n * seq_len + 1]), dtype=torch.uint8).long()
    return data[:-1].view(n, seq_len).clone(), data[1:].view(n, seq_len).clone()


@dataclass(frozen=True)
class Corpus:
    """What the data set was read from, for the rows."""

    python: str
    files: int  # in the corpus
    train_files: int  # read (the cap may stop before the split's last)
    test_files: int
    train_bytes: int
    test_bytes: int
    sha256: str  # of the train bytes, then the held-out bytes

    def describe(self) -> str:
        return (
            f"python-stdlib {self.python}: {self.train_files} train + {self.test_files} held-out of {self.files} "
            f".py files, {self.train_bytes} + {self.test_bytes} bytes, sha256 {self.sha256[:12]}"
        )


@dataclass
class TextData:
    x_train: torch.Tensor  # int64 (N, S) byte ids
    y_train: torch.Tensor  # int64 (N, S): the next bytes
    x_test: torch.Tensor
    y_test: torch.Tensor
    corpus: Corpus
    num_classes: int = BYTES


def load_text(cfg: QualityConfig, seed: int = 0, root: Path | None = None) -> TextData:
    """The corpus split by file (``seed``; ``run_quality`` uses 0, one split for every seed), capped, in windows."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise KdbenchError(f"quality: the standard library folder {root} is not there; python-stdlib reads it")
    files = stdlib_files(root)
    train, test = split_files(files, cfg.test_fraction, seed)
    test_cap = None if cfg.max_bytes is None else round(cfg.max_bytes * cfg.test_fraction)
    train_cap = None if cfg.max_bytes is None else cfg.max_bytes - test_cap  # type: ignore[operator]
    train_blob, n_train = _join(root, train, train_cap)
    test_blob, n_test = _join(root, test, test_cap)
    seq_len = cfg.text_seq_len
    x_tr, y_tr = windows(train_blob, seq_len)
    x_te, y_te = windows(test_blob, seq_len)
    sha = hashlib.sha256(train_blob + test_blob).hexdigest()
    corpus = Corpus(platform.python_version(), len(files), n_train, n_test, len(train_blob), len(test_blob), sha)
    return TextData(x_tr, y_tr, x_te, y_te, corpus)


def check_text(cfg: QualityConfig, configs: Iterable[CellConfig]) -> None:
    """The cheap checks, before anything runs: language-model cells, the windows within their positions."""
    from kdbench.models.lm import max_positions, model_config
    from kdbench.workloads import workload_of

    for c in configs:
        workload = workload_of(c)
        if workload.quality_data != "text":
            what = (
                "an image pair; use dataset digits, imagefolder or cifar"
                if workload.quality_data == "images"
                else f"of the {workload.family} family, not causal LMs"
            )
            raise KdbenchError(
                f"quality dataset {cfg.dataset} trains causal language models on text, and the pair "
                f"{c.pair.teacher} -> {c.pair.student} is {what}"
            )
        for role in ("teacher", "student"):
            name = getattr(c.pair, role)
            try:
                config = model_config(name, byte_overrides(name, getattr(c.overrides, role)))
            except KdbenchError:
                continue  # the cell's own checks report it
            limit = max_positions(config)
            if limit is not None and cfg.text_seq_len > limit:
                raise KdbenchError(
                    f"quality.seq_len {cfg.text_seq_len} is beyond the {role} {name}'s {limit} positions; lower it"
                )
            spec = cfg.speculative
            need = None if spec is None else spec.prompt_length(cfg.text_seq_len) + spec.new_tokens
            if need is not None and limit is not None and need > limit:
                raise KdbenchError(
                    f"quality.speculative: prompt_tokens + new_tokens = {need} is "
                    f"beyond the {role} {name}'s {limit} positions; lower new_tokens"
                )
    if not stdlib_root().is_dir():
        raise KdbenchError(f"the standard library folder {stdlib_root()} is not there; python-stdlib reads it")


def byte_overrides(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The model's overrides with the byte vocabulary (a ``module:callable`` takes none: it must have 256)."""
    return dict(overrides) if is_callable_name(name) else {**overrides, "vocab_size": BYTES}


def text_columns(cfg: QualityConfig) -> dict[str, Any]:
    """The text columns of a planned row (the corpus's are added once it is read; with ``speculative``, the draft
    columns, which a student's row fills)."""
    drafts = dict.fromkeys(DRAFT_ROW_KEYS) if cfg.speculative is not None else {}
    return dict.fromkeys(TEXT_ROW_KEYS) | {"seq_len": cfg.text_seq_len} | drafts


TEXT_ROW_KEYS = (
    "perplexity",
    "best_perplexity",
    "bits_per_byte",
    "perplexity_by_epoch",
    "train_time_by_epoch_s",
    "seq_len",
    "quality_corpus",
    "quality_train_tokens",
    "quality_test_tokens",
)


# --------------------------------------------------------------------------- training and evaluation


def evaluate_text(
    model: nn.Module, data: DeviceData, choice: AutocastChoice, backend: Backend
) -> tuple[float, torch.Tensor, float]:
    """(next-byte top-1 accuracy, the argmax per held-out byte on the CPU, mean next-byte cross-entropy in nats),
    in eval mode under inference_mode; the model's mode is restored."""
    was_training = model.training
    model.eval()
    batch = max(1, EVAL_TOKENS // data.x_test.shape[1])
    total, count, preds = 0.0, 0, []
    try:
        with torch.inference_mode(), choice.context(backend.device_type):
            for i in range(0, len(data.x_test), batch):
                logits = model.logits(model(data.x_test[i : i + batch])).float()
                if logits.shape[-1] != BYTES:
                    raise KdbenchError(f"the model has {logits.shape[-1]} outputs per token; byte-level text needs 256")
                y = data.y_test[i : i + batch].to(logits.device)
                total += float(
                    F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
                )
                count += int((y != IGNORE_INDEX).sum())
                preds.append(logits.argmax(dim=-1).flatten().cpu())
    finally:
        model.train(was_training)
    out = torch.cat(preds)
    accuracy = int((out == data.y_test.flatten()).sum()) / max(count, 1)
    return accuracy, out, total / max(count, 1)


def reach_perplexity(result: Trained, threshold: float) -> tuple[float | None, int | None]:
    """(training seconds, 1-based epoch) at the end of the first epoch with perplexity <= threshold."""
    for epoch, ((seconds, _), loss) in enumerate(zip(result.history, result.test_losses), 1):
        if math.exp(loss) <= threshold:
            return seconds, epoch
    return None, None


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # a diverged model: a huge but finite perplexity


class TextRun(QualityRun):
    """The quality protocol's run with language models on text: the data, the models and their record."""

    def __init__(
        self, cfg: QualityConfig, backend: Backend, allow_imports: bool, checkpoints: Checkpoints | None = None
    ):
        super().__init__(cfg, backend, allow_imports, checkpoints)
        self.text: TextData | None = None
        self.device_text: DeviceData | None = None

    def data(self, c: CellConfig) -> DeviceData:
        if self.device_text is None:
            self.text = t = load_text(self.cfg, seed=0)
            dev = self.backend.device
            self.device_text = DeviceData(
                t.x_train.to(dev), t.y_train.to(dev), t.x_test.to(dev), t.y_test, BYTES, torch.contiguous_format
            )
            spec = self.cfg.speculative
            if spec is not None and spec.prompts > len(t.x_test):
                raise KdbenchError(
                    f"quality.speculative.prompts {spec.prompts} is more than the {len(t.x_test)} held-out windows the "
                    "prompts are cut from; lower it or raise max_bytes"
                )
        return self.device_text

    @property
    def keeps_students(self) -> bool:
        return self.cfg.speculative is not None  # each is measured as a draft once trained

    def reused_times(self, role: str) -> str:
        if role == "teacher" or not self.keeps_students:
            return super().reused_times(role)
        return (
            "its training times are that invocation's; its draft figures (draft_*) are this invocation's, measured now"
        )

    def cell(self, c: CellConfig, seed: int) -> CellConfig:
        """The image protocol's cell, with the byte vocabulary over the overrides and the block's windows."""
        cell = super().cell(c, seed)
        overrides = cell.overrides.model_copy(
            update={r: byte_overrides(getattr(c.pair, r), getattr(c.overrides, r)) for r in ("teacher", "student")}
        )
        data = cell.data.model_copy(update={"seq_len": self.cfg.text_seq_len})
        return cell.model_copy(update={"overrides": overrides, "data": data})

    def model(self, name: str, cell: CellConfig, role: str) -> nn.Module:
        from kdbench.models.lm import CausalLM, make_lm

        overrides = getattr(cell.overrides, role)
        seed = init_seed(cell.seed, role)
        key = ("lm", name, repr(sorted(overrides.items())), seed)
        lm = self.cache.get_built(key, seed, lambda: make_lm(name, overrides, self.cache.allow_imports))
        model = CausalLM(lm).to(self.backend.device)
        if model.vocab_size is not None and model.vocab_size != BYTES:
            raise KdbenchError(f"{name} has a vocabulary of {model.vocab_size}; byte-level text needs 256")
        return model

    def ce_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, choice: Any) -> Callable:
        return ce_step(model, optimizer, choice, self.backend, logits=lambda x: model.logits(model(x)))

    def fit(self, step: Callable, model: nn.Module, optimizer: Any, data: DeviceData, seed: int, choice: Any):
        def evaluate(m: nn.Module) -> tuple[float, torch.Tensor, float]:
            return evaluate_text(m, data, choice, self.backend)

        talk = self.talk
        return fit(step, model, optimizer, data, self.cfg, self.backend, seed, choice, evaluate=evaluate, talk=talk)

    def fill(self, row: dict[str, Any], result: Trained | str, reference: Trained | str | None) -> dict[str, Any]:
        if self.text is not None:
            c = self.text.corpus
            row.update(
                quality_corpus=c.describe(),
                quality_train_tokens=int(self.text.y_train.numel()),
                quality_test_tokens=int(self.text.y_test.numel()),
            )
        if isinstance(result, str):
            return super().fill(row, result, reference)
        losses = result.test_losses
        row.update(
            accuracy=result.accuracy,
            best_accuracy=result.best_accuracy,
            train_time_s=result.train_time_s,
            perplexity=_perplexity(losses[-1]),
            best_perplexity=_perplexity(min(losses)),
            bits_per_byte=losses[-1] / math.log(2),
            perplexity_by_epoch=[_perplexity(v) for v in losses],
            train_time_by_epoch_s=[s for s, _ in result.history],
        )
        if isinstance(reference, Trained):
            seconds, epoch = reach_perplexity(result, _perplexity(reference.test_losses[-1]) / self.cfg.target)
            row.update(time_to_target_s=seconds, epochs_to_target=epoch)
            if reference is not result:
                row["agreement"] = float((result.preds == reference.preds).float().mean())
                if self.cfg.speculative is not None:
                    self.draft(row, result, reference)
        return row

    def draft(self, row: dict[str, Any], student: Trained, teacher: Trained) -> None:
        """``row`` with the student's figures as the draft of its seed's teacher (:mod:`kdbench.quality.drafts`);
        a note instead where they could not be measured.  The student's model is let go once measured."""
        spec, seed = self.cfg.speculative, row["seed"]
        what = f"quality seed {seed}: {row['quality_role']} {row['method'] or row['student']}"
        began = time.perf_counter()
        try:
            if student.model is None or teacher.model is None:
                raise ValueError("the trained models are not at hand")
            choice = choose_autocast(self.backend, row["precision"])
            assert self.device_text is not None, "the data is loaded before any model trains"
            x_test = self.device_text.x_test
            row.update(measure_draft(teacher.model, student.model, x_test, spec, choice, self.backend, seed, BYTES))
        except Exception as exc:  # the row's training figures stand; the draft's are missing, and it says why
            note = f"draft figures not measured: {error_text(exc)}"
            row["notes"] = "; ".join(n for n in (row["notes"], note) if n)
            logger.info("  %s: %s", what, note)
        else:
            logger.info("  %s: %s; measured in %.1f s", what, describe_draft(row), time.perf_counter() - began)
        finally:
            student.model = None

    def describe(self, result: Trained, agreement: float | None = None) -> str:
        loss = result.test_losses[-1]
        text = (
            f"perplexity {_perplexity(loss):.3f} ({loss / math.log(2):.3f} bits/byte), next-byte top-1 "
            f"{result.accuracy:.1%}, {result.train_time_s:.2f} s training"
        )
        return text + (f", agreement {agreement:.1%}" if agreement is not None else "")
