"""Training on real data: the loop every quality model follows, its test record, and one quality run.

:func:`fit` runs ``cfg.epochs`` epochs of a step function over shuffled mini-batches
with a cosine learning-rate schedule, evaluating the test split after every epoch (not
counted as training time).  Training drops each epoch's last incomplete mini-batch
(batch norm cannot train on a batch of one); the shuffling changes which samples those
are every epoch.

:class:`QualityRun` holds one quality run's data on the device and the models trained so far,
and trains each model the protocol (:mod:`kdbench.quality.protocol`) plans: a teacher or a
scratch student with cross-entropy (:func:`ce_step`), a student distilled through
``Distiller.train_step``; :class:`kdbench.quality.text.TextRun` is the same run with language
models on text.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kdbench.config.plan import config_dict
from kdbench.config.quality import QualityConfig
from kdbench.config.schema import CellConfig, TeacherConfig
from kdbench.core.names import IGNORE_INDEX, Status
from kdbench.data.datasets import Dataset, load_dataset
from kdbench.distill.losses import method_parts
from kdbench.distill.losses.registry import training_epoch
from kdbench.distill.step import Distiller, backward_and_update, make_optimizer
from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast, grad_scaler, math_mode
from kdbench.hw.layout import memory_format_of, place_model
from kdbench.measure.failures import error_text
from kdbench.models import ModelCache
from kdbench.quality.checkpoints import CHECKPOINTS_DIR, Checkpoints, tensors_digest
from kdbench.quality.progress import Talk
from kdbench.workloads import workload_of

logger = logging.getLogger(__name__)

EVAL_BATCH = 512


@dataclass
class Trained:
    """A trained model's test record; `model` kept for teachers, and for students where the run measures them once
    trained (:attr:`QualityRun.keeps_students`)."""

    history: list[tuple[float, float]]  # (training seconds so far, test accuracy) after each epoch
    preds: torch.Tensor  # test predictions after the last epoch (CPU)
    model: nn.Module | None = None
    test_losses: list[float] = field(default_factory=list)  # the test loss after each epoch, where one is measured
    identity: dict[str, Any] | None = None  # what it was trained with, where checkpoints are kept (quality.checkpoints)
    note: str | None = None  # for its row: taken from its checkpoint, or trained again and why
    tokens_per_byte: float = 1.0  # its tokenizer's held-out tokens per predicted byte (text: bits per byte)

    def record(self) -> dict[str, Any]:
        """What its checkpoint keeps of it besides the weights: all its row is made from."""
        return {"history": [list(h) for h in self.history], "test_losses": list(self.test_losses), "preds": self.preds}

    @classmethod
    def from_record(cls, record: dict[str, Any], **fields: Any) -> Trained:
        history = [(float(s), float(a)) for s, a in record["history"]]
        return cls(history, record["preds"], test_losses=[float(v) for v in record["test_losses"]], **fields)

    @property
    def accuracy(self) -> float:
        return self.history[-1][1]

    @property
    def best_accuracy(self) -> float:
        return max(a for _, a in self.history)

    @property
    def train_time_s(self) -> float:
        return self.history[-1][0]

    def reach(self, threshold: float) -> tuple[float | None, int | None]:
        """(training seconds, 1-based epoch) at the end of the first epoch with accuracy >= threshold."""
        for epoch, (seconds, acc) in enumerate(self.history, 1):
            if acc >= threshold:
                return seconds, epoch
        return None, None


@dataclass
class DeviceData:
    """The data set on the device, in the cells' memory format."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor  # CPU, compared with CPU predictions
    num_classes: int
    fmt: torch.memory_format


def predict(
    model: nn.Module,
    x: torch.Tensor,
    choice: AutocastChoice,
    backend: Backend,
    fmt: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """Top-1 classes of `x` (CPU int64), in eval mode under inference_mode; the model's mode is restored."""
    was_training = model.training
    model.eval()
    out = []
    try:
        with torch.inference_mode(), choice.context(backend.device_type):
            for i in range(0, len(x), EVAL_BATCH):
                out.append(model(x[i : i + EVAL_BATCH].contiguous(memory_format=fmt)).argmax(dim=1))
    finally:
        model.train(was_training)
    return torch.cat(out).cpu()


def _accuracy(preds: torch.Tensor, y: torch.Tensor) -> float:
    return int((preds == y).sum()) / len(y)


# model -> (test accuracy, test predictions on the CPU, mean test loss or None)
Evaluate = Callable[[nn.Module], tuple[float, torch.Tensor, float | None]]


def fit(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DeviceData,
    cfg: QualityConfig,
    backend: Backend,
    seed: int,
    choice: AutocastChoice,
    evaluate: Evaluate | None = None,
    talk: Talk | None = None,
) -> Trained:
    """`cfg.epochs` epochs of `step(x, y, indices)` over mini-batches shuffled by a generator seeded with `seed`.

    A cosine schedule anneals `optimizer`'s learning rate over all steps.  Only the
    steps are timed; the evaluation after each epoch is not.  The steps of epoch e
    (1-based) run inside ``training_epoch(e)``: the loss terms that count epochs see it.
    ``evaluate`` replaces the top-1 evaluation of a classifier (the text protocol's next-byte one,
    which also measures the test loss).  ``talk`` hears the start and every step (it speaks every 30 s).
    """
    torch.manual_seed(seed)  # anything random inside the model (dropout) starts the same way
    n = len(data.x_train)
    bs = min(cfg.batch_size, n)
    steps = max(1, n // bs)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps * cfg.epochs)
    order = torch.Generator().manual_seed(seed)
    device = data.x_train.device
    history: list[tuple[float, float]] = []
    test_losses: list[float] = []
    seconds = 0.0
    loss = None
    preds = torch.empty(0, dtype=torch.int64)
    if talk is not None:
        talk.training(cfg.epochs, steps)
    for epoch in range(1, cfg.epochs + 1):  # 1-based, as mdistiller's trainer (and Trained.reach) count
        perm = torch.randperm(n, generator=order)
        backend.synchronize()
        start = time.perf_counter()
        perm = perm.to(device)
        with training_epoch(epoch):  # the loss terms see the epoch (ReviewKD's warm-up counts epochs)
            for i in range(steps):
                idx = perm[i * bs : (i + 1) * bs]
                loss = step(data.x_train[idx].contiguous(memory_format=data.fmt), data.y_train[idx], idx)
                schedule.step()
                if talk is not None:
                    talk.step(epoch, i + 1, loss)
        backend.synchronize()
        seconds += time.perf_counter() - start
        if evaluate is None:
            preds = predict(model, data.x_test, choice, backend, data.fmt)
            history.append((seconds, _accuracy(preds, data.y_test)))
        else:
            accuracy, preds, test_loss = evaluate(model)
            history.append((seconds, accuracy))
            if test_loss is not None:
                test_losses.append(test_loss)
    if loss is not None and not math.isfinite(float(loss)):
        raise RuntimeError(
            f"the training loss is not finite ({float(loss)}) after {cfg.epochs} epochs; "
            "lower quality.lr or use bf16/fp32"
        )
    return Trained(history, preds, test_losses=test_losses)


def ce_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    choice: AutocastChoice,
    backend: Backend,
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One cross-entropy step (loss in FP32; a GradScaler for fp16), as teachers and scratch students train:
    ``logits(x)`` (by default the model's output; a language model's next-token logits, (B, S, V)) against
    ``y``, the labels of -100 (``IGNORE_INDEX``) not counted."""
    scaler = grad_scaler(backend, choice)
    forward = logits or model

    def step(x: torch.Tensor, y: torch.Tensor, _indices: torch.Tensor | None = None) -> torch.Tensor:
        with choice.context(backend.device_type):
            out = forward(x)
        loss = F.cross_entropy(out.float().flatten(0, -2), y.flatten(), ignore_index=IGNORE_INDEX)
        optimizer.zero_grad(set_to_none=True)
        backward_and_update(loss, optimizer, scaler)
        return loss.detach()

    return step


# --------------------------------------------------------------------------- one quality run


ModelKey = tuple  # what makes a model the same as another cell's (kdbench.workloads.base.Workload.model_key)


def init_seed(seed: int, role: str) -> int:
    """Teachers and students of one seed start from different draws (2s + 1 and 2s)."""
    return 2 * seed + (1 if role == "teacher" else 0)


def bank_sized(cell: CellConfig, n_train: int) -> CellConfig:
    """A CRD cell's memory bank sized to the training set (one entry per sample, indexed by the samples'
    data-set indices), with at most n_train - 1 negatives per sample."""
    if "crd" not in method_parts(cell.method):
        return cell
    crd = cell.crd.model_copy(update={"n_data": n_train, "nce_k": min(cell.crd.nce_k, max(1, n_train - 1))})
    return cell.model_copy(update={"crd": crd})


def _describe(result: Trained, agreement: float | None = None) -> str:
    text = f"top-1 {result.accuracy:.1%} (best {result.best_accuracy:.1%}), {result.train_time_s:.2f} s training"
    return text + (f", agreement {agreement:.1%}" if agreement is not None else "")


def _results(row: dict[str, Any], cfg: QualityConfig, result: Trained, reference: Trained | None) -> dict[str, Any]:
    """``row`` with the record of ``result``, measured against ``reference`` (the seed's teacher)."""
    row.update(accuracy=result.accuracy, best_accuracy=result.best_accuracy, train_time_s=result.train_time_s)
    if reference is not None:
        seconds, epoch = result.reach(cfg.target * reference.accuracy)
        row.update(time_to_target_s=seconds, epochs_to_target=epoch)
        if reference is not result:
            row["agreement"] = float((result.preds == reference.preds).float().mean())
    return row


def _fill(row: dict[str, Any], cfg: QualityConfig, result: Trained | str, reference: Trained | str | None):
    """``row`` with ``result``'s record, or failed with its error."""
    if isinstance(result, str):
        row.update(status=Status.FAILED, error=result)
        return row
    return _results(row, cfg, result, reference if isinstance(reference, Trained) else None)


class QualityRun:
    """The state of one quality run: data on the device, and the models trained so far per seed; how each is
    trained.  :func:`kdbench.quality.protocol.run_quality` says which, in which order, into which rows."""

    def __init__(
        self, cfg: QualityConfig, backend: Backend, allow_imports: bool, checkpoints: Checkpoints | None = None
    ):
        self.cfg, self.backend = cfg, backend
        self.cache = ModelCache(allow_imports, capacity=64)
        self.datasets: dict[tuple[int, ...], Dataset] = {}
        self.on_device: dict[tuple[tuple[int, ...], str], DeviceData] = {}
        self.trained: dict[tuple[int, str, ModelKey], Trained | str] = {}  # (seed, teacher|scratch, key): or error
        self.checkpoints = checkpoints  # where each trained model is kept (None: nowhere)
        self.talk = Talk(0)  # the job's progress lines (run_quality gives it the plan's)
        self.digests: dict[int, str] = {}  # id(DeviceData) -> the SHA-256 of its tensors

    def data(self, c: CellConfig) -> DeviceData:
        shape = tuple(c.data.shape)
        if shape not in self.datasets:
            self.datasets[shape] = load_dataset(self.cfg, shape, seed=0)
        key = (shape, c.memory_format)
        if key not in self.on_device:
            d, dev, fmt = self.datasets[shape], self.backend.device, memory_format_of(c.memory_format)
            self.on_device[key] = DeviceData(
                d.x_train.to(dev).contiguous(memory_format=fmt),
                d.y_train.to(dev),
                d.x_test.to(dev).contiguous(memory_format=fmt),
                d.y_test,
                d.num_classes,
                fmt,
            )
        return self.on_device[key]

    def cell(self, c: CellConfig, seed: int) -> CellConfig:
        """The job's cell for quality: the data set's classes, no padding, a live teacher, the quality recipe."""
        return c.model_copy(
            update={
                "data": c.data.model_copy(update={"num_classes": self.data(c).num_classes}),
                "pad_to": 1,
                "teacher": c.teacher if c.teacher.mode == "offline" else TeacherConfig(mode="live"),
                "optimizer": self.cfg.optimizer_config(),
                "batch_size": self.cfg.batch_size,
                "world_size": 1,
                "seed": seed,
            }
        )

    def model(self, name: str, cell: CellConfig, role: str) -> nn.Module:
        model = self.cache.get(name, cell.data.num_classes, tuple(cell.data.shape), init_seed(cell.seed, role))
        return place_model(model, self.backend.device, cell.memory_format, True)

    def ce_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, choice: Any) -> Callable:
        return ce_step(model, optimizer, choice, self.backend)

    def fit(self, step: Callable, model: nn.Module, optimizer: Any, data: DeviceData, seed: int, choice: Any):
        return fit(step, model, optimizer, data, self.cfg, self.backend, seed, choice, talk=self.talk)

    def fill(self, row: dict[str, Any], result: Trained | str, reference: Trained | str | None) -> dict[str, Any]:
        return _fill(row, self.cfg, result, reference)

    def describe(self, result: Trained, agreement: float | None = None) -> str:
        return _describe(result, agreement)

    def attempt(self, what: str, fn: Callable[[], Trained]) -> Trained | str:
        """``fn()``, logged; its one-line error instead when it raises (the run goes on)."""
        try:
            result = fn()
        except Exception as exc:
            if self.backend.device_type == "cuda":
                torch.cuda.empty_cache()
            logger.info("  %s: FAILED: %s", what, error_text(exc))
            return error_text(exc)
        return result

    def identity(self, cell: CellConfig, role: str, teacher: Trained | None = None) -> dict[str, Any]:
        """What a model of ``role`` trained as the quality cell ``cell`` is trained with: a checkpoint is reused only
        for the same (:mod:`kdbench.quality.checkpoints`)."""
        data = self.data(cell)
        if id(data) not in self.digests:
            self.digests[id(data)] = tensors_digest(data.x_train, data.y_train, data.x_test, data.y_test)
        return {
            "format": 1,
            "role": role,
            "quality": self.cfg.model_dump(mode="json", exclude={"speculative"}),  # measured after: not trained with
            "cell": config_dict(cell),
            "data": self.digests[id(data)],
            "threads": torch.get_num_threads(),
            "backend": self.backend.name,
            "torch": str(torch.__version__),
            "teacher": None if teacher is None else teacher.identity,
        }

    def kept(
        self,
        seed: int,
        role: str,
        which: Any,
        cell: CellConfig,
        train: Callable[[], tuple[Trained, nn.Module]],
        teacher: Trained | None = None,
        rebuild: Callable[[dict[str, torch.Tensor]], nn.Module] | None = None,
    ) -> Trained:
        """``train()``'s model and record, stored as a checkpoint once trained; or, where this run already holds its
        checkpoint with the same identity, the stored record (and with ``rebuild``, the model from its weights)."""
        if self.checkpoints is None:
            return train()[0]
        identity = self.identity(cell, role, teacher)
        path = self.checkpoints.path(seed, role, which)
        stored, why = self.checkpoints.load(path, identity)
        if stored is not None:
            note = (
                f"reused: trained by an earlier invocation of this run and kept in its checkpoint "
                f"{CHECKPOINTS_DIR}/{path.parent.name}/{path.name} (saved {stored.saved}); " + self.reused_times(role)
            )
            out = Trained.from_record(stored.record, identity=identity, note=note)
            if rebuild is not None:
                out.model = rebuild(stored.state_dict)
            figures = "" if teacher is not None else f": {self.describe(out)}"  # a student's come with its row
            kept = f"taken from its checkpoint {path.name} (saved {stored.saved}), not trained again{figures}"
            self.talk.reused(kept)
            return out
        if why:
            logger.info("%s: %s: training it again", self.talk.head, why)
        out, model = train()
        out.identity, out.note = identity, (f"trained again: {why}" if why else None)
        try:
            self.checkpoints.save(path, identity, out.record(), model)
        except (OSError, RuntimeError) as exc:  # a full disk: the model is trained all the same, only not kept
            logger.warning("%s: not kept, a resume would train it again: %s", self.talk.head, error_text(exc))
        return out

    @property
    def keeps_students(self) -> bool:
        """Whether a student's trained model is kept with its record (and rebuilt from its checkpoint on a resume),
        for a measurement after its training (:class:`kdbench.quality.text.TextRun`'s drafts)."""
        return False

    def reused_times(self, role: str) -> str:
        """What a row made from a kept model says of its times."""
        return "its times are that invocation's"

    def train_ce(self, config: CellConfig, seed: int, role: str, key: ModelKey) -> Trained | str:
        """The seed's teacher or scratch student (the model ``key`` names, of the planned cell ``config``), trained
        with cross-entropy once and remembered (and kept as a checkpoint where the run keeps them)."""
        if (seed, role, key) not in self.trained:
            cell = self.cell(config, seed)
            name = key[0]
            kind = "teacher" if role == "teacher" else "student"

            def train() -> tuple[Trained, nn.Module]:
                model = self.model(name, cell, kind)
                model.train()
                optimizer = make_optimizer(model.parameters(), cell.optimizer)
                choice = choose_autocast(self.backend, cell.precision)
                step = self.ce_step(model, optimizer, choice)
                with math_mode(choice.tf32):
                    out = self.fit(step, model, optimizer, self.data(cell), seed, choice)
                if role == "teacher" or self.keeps_students:
                    out.model = model
                logger.info("  quality seed %d: %s %s: %s", seed, role, name, self.describe(out))
                return out, model

            def rebuild(state: dict[str, torch.Tensor]) -> nn.Module:
                model = self.model(name, cell, kind)
                model.load_state_dict(state)
                return model.train()

            self.trained[(seed, role, key)] = self.attempt(
                f"quality seed {seed}: {role} {name}",
                lambda: self.kept(
                    seed,
                    role,
                    repr(key),
                    cell,
                    train,
                    rebuild=rebuild if role == "teacher" or self.keeps_students else None,
                ),
            )
        return self.trained[(seed, role, key)]

    def distil(self, config: CellConfig, seed: int, teacher: Trained) -> Trained:
        """A fresh student of the planned cell ``config`` distilled from ``teacher``, the seed's trained one."""
        cell = self.cell(config, seed)

        def train() -> tuple[Trained, nn.Module]:
            data = self.data(cell)
            sized = bank_sized(cell, len(data.x_train))
            student = self.model(sized.pair.student, sized, "student")
            teacher_copy = copy.deepcopy(teacher.model)
            distiller = Distiller(teacher_copy, student, sized, self.backend, data.x_train[:2], workload_of(sized))
            stored = None  # teacher.mode offline: the teacher's top-k over the windows, read from disk each step
            try:
                if sized.teacher.mode == "offline":
                    from kdbench.quality.offline import OfflineBatches

                    stored = OfflineBatches(distiller, sized, data.x_train, data.y_train)
                model, opt = distiller.student, distiller.optimizer

                def step(x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
                    cached = stored.batch(indices) if stored is not None and indices is not None else None
                    return distiller.train_step(x, y, cached, indices=indices)

                with math_mode(distiller.student_ac.tf32):
                    out = self.fit(step, model, opt, data, seed, distiller.student_ac)
            finally:
                distiller.close()
                if stored is not None:
                    stored.close()
            if self.keeps_students:
                out.model = model
            return out, model

        def rebuild(state: dict[str, torch.Tensor]) -> nn.Module:
            sized = bank_sized(cell, len(self.data(cell).x_train))
            model = self.model(sized.pair.student, sized, "student")
            model.load_state_dict(state)
            return model.train()

        keep = rebuild if self.keeps_students else None
        return self.kept(seed, "distilled", config_dict(config), cell, train, teacher=teacher, rebuild=keep)
