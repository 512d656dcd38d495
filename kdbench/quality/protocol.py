"""Quality: does a distilled student learn?  Accuracy, agreement and time to quality on real data.

A suite may opt in with ``quality: {dataset: digits, epochs: 20, seeds: 3, target: 0.95}``.
For each seed the protocol trains, from scratch and with fixed seeds,

* each distinct **teacher** with cross-entropy (``quality_role: teacher``);
* each distinct **student** with cross-entropy alone (``scratch``), once per seed;
* the student distilled from that seed's trained teacher with each method the suite
  plans (``distilled``), through the same ``Distiller.train_step`` the timed cells use.

All of them follow one recipe (``QualityConfig``: optimizer, learning rate with a
cosine schedule over every step, batch size, epochs) and, within a seed, see the
mini-batches in the same order.  A scratch student and a distilled student of one
seed start from identical weights; the teacher starts from other ones (a student of
the teacher's architecture would otherwise be trained into the teacher itself).

After every epoch the test set is evaluated (eval mode, ``inference_mode``; not
counted as training time).  Each trained model gives one row (``ROW_KEYS``):

* ``accuracy``: top-1 on the test split after the last epoch; ``best_accuracy``: the
  best epoch's.
* ``agreement``: the fraction of test samples where the student predicts the class
  its seed's teacher predicts (both after the last epoch).
* ``time_to_target_s``: training wall time (``perf_counter``, the device synchronised
  before reading it) accumulated until the end of the first epoch whose accuracy is
  at least ``target`` x that seed's teacher accuracy (MLPerf training's time to
  quality, at epoch granularity); ``None`` when never reached.  For a teacher row the
  threshold is ``target`` x its own final accuracy (always reached, at the latest in
  the last epoch): how fast the teacher itself gets there.
* ``train_time_s``: all training wall time; ``epochs_to_target``: the epoch (1-based).

Data sets (``load_dataset``): ``digits`` (scikit-learn's 1797 8x8 handwritten digits,
shipped with the package: no download), or images on disk read with torchvision
(``download=False``): ``imagefolder``, ``cifar10``, ``cifar100`` under ``quality.root``.
Everything is held in memory as float32 ``(N, C, H, W)``, resized to the cells'
``data.shape`` and standardised with the training split's per-channel mean and std.

Training drops each epoch's last incomplete mini-batch (batch norm cannot train on a
batch of one); the shuffling changes which samples those are every epoch.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kdbench.config.schema import DISK_DATASETS, CellConfig, QualityConfig, TeacherConfig
from kdbench.distill.step import Distiller, make_optimizer
from kdbench.errors import KdbenchError
from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast, grad_scaler
from kdbench.hw.data import memory_format_of
from kdbench.measure.cell import ModelCache, _error_text, _on_device

ROLES = ("teacher", "scratch", "distilled")
EVAL_BATCH = 512

ROW_KEYS = (
    "measurement",
    "status",
    "error",
    "quality_role",
    "teacher",
    "student",
    "method",
    "seed",
    "quality_dataset",
    "quality_epochs",
    "quality_target",
    "accuracy",
    "best_accuracy",
    "agreement",
    "time_to_target_s",
    "train_time_s",
    "epochs_to_target",
    "batch_size",
    "precision",
)


# --------------------------------------------------------------------------- data


class Dataset(NamedTuple):
    x_train: torch.Tensor  # float32 (N, C, H, W), standardised
    y_train: torch.Tensor  # int64 (N,)
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int


def _image_shape(shape: Iterable[int]) -> tuple[int, int, int]:
    shape = tuple(shape)
    if len(shape) != 3 or any(not isinstance(d, int) or d < 1 for d in shape):
        raise KdbenchError(
            f"quality needs image models: data.shape must be [C, H, W] (got {list(shape)}); "
            "remove the quality block or use image data"
        )
    return shape  # type: ignore[return-value]


def _split(targets: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    try:
        train, test = train_test_split(
            np.arange(len(targets)), test_size=test_fraction, stratify=targets, random_state=seed
        )
    except ValueError as exc:
        raise KdbenchError(
            f"quality.test_fraction: cannot split {len(targets)} samples of "
            f"{len(np.unique(targets))} classes stratified ({exc}); add samples or change "
            "test_fraction"
        ) from None
    return np.sort(train), np.sort(test)


def _subsample(targets: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Indices of `n` of the samples, stratified when the classes allow it (all of them if n >= len)."""
    if n >= len(targets):
        return np.arange(len(targets))
    from sklearn.model_selection import train_test_split

    try:
        keep, _ = train_test_split(np.arange(len(targets)), train_size=n, stratify=targets, random_state=seed)
    except ValueError:  # fewer samples kept than classes, or a class of one
        keep = np.random.default_rng(seed).permutation(len(targets))[:n]
    return np.sort(keep)


def _caps(cfg: QualityConfig, n_train: int, n_test: int) -> tuple[int, int]:
    """max_samples shared between a data set's own train and test splits, in proportion."""
    if cfg.max_samples is None or cfg.max_samples >= n_train + n_test:
        return n_train, n_test
    test = min(n_test, max(1, round(cfg.max_samples * n_test / (n_train + n_test))))
    return max(1, cfg.max_samples - test), test


def _standardise(x_train: torch.Tensor, x_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True, unbiased=False)
    std = torch.where(std > 1e-12, std, torch.ones_like(std))  # a constant channel stays as it is, centred
    return ((x_train - mean) / std).contiguous(), ((x_test - mean) / std).contiguous()


def _to_channels(x: torch.Tensor, c: int) -> torch.Tensor:
    """(N, k, H, W) with k 1 or c -> (N, c, H, W); grey replicated to every channel."""
    return x if x.shape[1] == c else x.expand(-1, c, -1, -1).contiguous()


def _digits(cfg: QualityConfig, shape: tuple[int, int, int], seed: int):
    from sklearn.datasets import load_digits

    c, h, w = shape
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0  # (1797, 1, 8, 8) in [0, 1]
    y = np.asarray(d.target, dtype=np.int64)
    if cfg.max_samples is not None:
        keep = _subsample(y, cfg.max_samples, seed)
        x, y = x[keep], y[keep]
    if (h, w) != tuple(x.shape[2:]):
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)
    x = _to_channels(x, c)
    train, test = _split(y, cfg.test_fraction, seed)
    yt = torch.from_numpy(y)
    return x[train], yt[train], x[test], yt[test], 10


def _transform(shape: tuple[int, int, int]) -> Callable[[Any], torch.Tensor]:
    from torchvision import transforms as T

    c, h, w = shape
    mode = "RGB" if c == 3 else "L"  # any other channel count: grey, replicated
    return T.Compose([lambda img: img.convert(mode), T.Resize((h, w)), T.ToTensor()])


def _materialise(ds: Any, indices: np.ndarray, shape: tuple[int, int, int], where: Callable[[int], str]):
    """Load `indices` of a torchvision data set (its transform set) into one tensor."""
    xs, ys = [], []
    for i in indices:
        try:
            img, label = ds[int(i)]
        except OSError as exc:  # PIL.UnidentifiedImageError and unreadable files
            raise KdbenchError(
                f"quality.root: cannot read {where(int(i))} ({' '.join(str(exc).split())}); remove or replace that file"
            ) from None
        xs.append(img)
        ys.append(int(label))
    if not xs:
        raise KdbenchError("quality.root: no images were loaded; check quality.root and quality.max_samples")
    x = _to_channels(torch.stack(xs), shape[0])
    return x, torch.tensor(ys, dtype=torch.int64)


def _imagefolder(cfg: QualityConfig, shape: tuple[int, int, int], seed: int):
    from torchvision.datasets import ImageFolder

    root = Path(cfg.root)  # type: ignore[arg-type]
    layout = (
        f"expected {root}/<class>/<image> (one folder per class), or {root}/train/<class>/... and "
        f"{root}/val/<class>/..."
    )
    if not root.is_dir():
        raise KdbenchError(f"quality.root: {root} is not a folder; set quality.root to the image folder ({layout})")
    split_dirs = [(root / s).is_dir() for s in ("train", "val")]
    if any(split_dirs) and not all(split_dirs):
        have, lack = ("train", "val") if split_dirs[0] else ("val", "train")
        raise KdbenchError(
            f"quality.root: {root} has {have}/ but no {lack}/; add {lack}/ with the same class "
            f"folders, or put the class folders directly in {root}"
        )
    tf = _transform(shape)

    def open_folder(path: Path) -> Any:
        try:
            return ImageFolder(str(path), transform=tf)
        except (FileNotFoundError, OSError) as exc:
            raise KdbenchError(f"quality.root: {' '.join(str(exc).split())} ({layout})") from None

    def where(ds: Any) -> Callable[[int], str]:
        return lambda i: ds.samples[i][0]

    if all(split_dirs):
        train_ds, test_ds = open_folder(root / "train"), open_folder(root / "val")
        if train_ds.classes != test_ds.classes:
            raise KdbenchError(
                f"quality.root: {root}/train and {root}/val hold different class folders "
                f"({train_ds.classes} vs {test_ds.classes}); give both the same classes"
            )
        classes = train_ds.classes
        n_train, n_test = _caps(cfg, len(train_ds), len(test_ds))
        x_tr, y_tr = _materialise(
            train_ds, _subsample(np.asarray(train_ds.targets), n_train, seed), shape, where(train_ds)
        )
        x_te, y_te = _materialise(test_ds, _subsample(np.asarray(test_ds.targets), n_test, seed), shape, where(test_ds))
    else:
        ds = open_folder(root)
        classes = ds.classes
        targets = np.asarray(ds.targets)
        keep = _subsample(targets, cfg.max_samples or len(targets), seed)
        train, test = _split(targets[keep], cfg.test_fraction, seed)
        x_tr, y_tr = _materialise(ds, keep[train], shape, where(ds))
        x_te, y_te = _materialise(ds, keep[test], shape, where(ds))
    if len(classes) < 2:
        raise KdbenchError(
            f"quality.root: {root} holds {len(classes)} class folder ({classes}); classification needs at least 2"
        )
    return x_tr, y_tr, x_te, y_te, len(classes)


def _cifar(cfg: QualityConfig, shape: tuple[int, int, int], seed: int):
    from torchvision.datasets import CIFAR10, CIFAR100

    cls, label, archive = {
        "cifar10": (CIFAR10, "CIFAR-10", "cifar-10-python.tar.gz"),
        "cifar100": (CIFAR100, "CIFAR-100", "cifar-100-python.tar.gz"),
    }[cfg.dataset]
    root = Path(cfg.root)  # type: ignore[arg-type]
    tf = _transform(shape)
    try:
        train_ds = cls(str(root), train=True, download=False, transform=tf)
        test_ds = cls(str(root), train=False, download=False, transform=tf)
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        hint = (
            f"; point quality.root at its parent folder, {root.parent}"
            if root.name == cls.base_folder
            else f"; download {archive} from https://www.cs.toronto.edu/~kriz/cifar.html and extract it in "
            f"{root} (nothing is downloaded for you)"
        )
        raise KdbenchError(
            f"quality.root: no {label} data in {root} (torchvision looks for "
            f"{root / cls.base_folder} with its original files){hint}"
        ) from None
    n_train, n_test = _caps(cfg, len(train_ds), len(test_ds))
    where = lambda i: f"{label} sample {i}"  # noqa: E731
    x_tr, y_tr = _materialise(train_ds, _subsample(np.asarray(train_ds.targets), n_train, seed), shape, where)
    x_te, y_te = _materialise(test_ds, _subsample(np.asarray(test_ds.targets), n_test, seed), shape, where)
    return x_tr, y_tr, x_te, y_te, len(train_ds.classes)


def load_dataset(cfg: QualityConfig, shape: Iterable[int], seed: int = 0) -> Dataset:
    """The quality data set in memory at `shape` ([C, H, W]), standardised with the train split's statistics.

    `seed` is the random_state of the stratified train/test split and of the
    ``max_samples`` subsample; ``run_quality`` uses 0, one fixed split for every seed.
    digits: pixels / 16, bilinear resize (align_corners=False), grey replicated to C
    channels.  Disk images: PIL convert (RGB for C = 3, else grey, replicated),
    torchvision Resize((H, W)) and ToTensor.
    """
    image = _image_shape(shape)
    if cfg.dataset in DISK_DATASETS and not cfg.root:
        raise KdbenchError(f"quality.root is required for dataset {cfg.dataset}; set it to the data set's folder")
    loader = {"digits": _digits, "imagefolder": _imagefolder, "cifar10": _cifar, "cifar100": _cifar}[cfg.dataset]
    x_tr, y_tr, x_te, y_te, num_classes = loader(cfg, image, seed)
    x_tr, x_te = _standardise(x_tr.float(), x_te.float())
    return Dataset(x_tr, y_tr.long(), x_te, y_te.long(), int(num_classes))


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class QualityJob:
    """One distillation to measure: a planned cell's pair, method, method settings, precision and layout."""

    config: CellConfig

    def __post_init__(self) -> None:
        if self.config.pair is None:
            raise ValueError("a quality job needs a cell with a pair")


def check_quality(cfg: QualityConfig, configs: Iterable[CellConfig]) -> None:
    """The cheap checks, before anything runs: image cells, and a data folder that exists."""
    for c in configs:
        _image_shape(c.data.shape)
    if cfg.dataset in DISK_DATASETS and cfg.root and not Path(cfg.root).expanduser().exists():
        raise KdbenchError(
            f"quality.root: {cfg.root} does not exist; give the folder that holds the "
            f"{cfg.dataset} data (nothing is downloaded)"
        )


def quality_jobs(configs: Iterable[CellConfig]) -> list[QualityJob]:
    """One job per distinct (teacher, student, method), from the first cell that has it, in plan order."""
    seen: dict[tuple[str, str, str], QualityJob] = {}
    for c in configs:
        if c.pair is not None:
            seen.setdefault((c.pair.teacher, c.pair.student, c.method), QualityJob(c))
    return list(seen.values())


@dataclass
class Trained:
    """A trained model's test record; `model` kept for teachers only."""

    history: list[tuple[float, float]]  # (training seconds so far, test accuracy) after each epoch
    preds: torch.Tensor  # test predictions after the last epoch (CPU)
    model: nn.Module | None = None

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
class _Data:
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


def fit(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: _Data,
    cfg: QualityConfig,
    backend: Backend,
    seed: int,
    choice: AutocastChoice,
) -> Trained:
    """`cfg.epochs` epochs of `step(x, y)` over mini-batches shuffled by a generator seeded with `seed`.

    A cosine schedule anneals `optimizer`'s learning rate over all steps.  Only the
    steps are timed; the evaluation after each epoch is not.
    """
    torch.manual_seed(seed)  # anything random inside the model (dropout) starts the same way
    n = len(data.x_train)
    bs = min(cfg.batch_size, n)
    steps = max(1, n // bs)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps * cfg.epochs)
    order = torch.Generator().manual_seed(seed)
    device = data.x_train.device
    history: list[tuple[float, float]] = []
    seconds = 0.0
    loss = None
    preds = torch.empty(0, dtype=torch.int64)
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=order)
        backend.synchronize()
        start = time.perf_counter()
        perm = perm.to(device)
        for i in range(steps):
            idx = perm[i * bs : (i + 1) * bs]
            loss = step(data.x_train[idx].contiguous(memory_format=data.fmt), data.y_train[idx])
            schedule.step()
        backend.synchronize()
        seconds += time.perf_counter() - start
        preds = predict(model, data.x_test, choice, backend, data.fmt)
        history.append((seconds, _accuracy(preds, data.y_test)))
    if loss is not None and not math.isfinite(float(loss)):
        raise RuntimeError(
            f"the training loss is not finite ({float(loss)}) after {cfg.epochs} epochs; "
            "lower quality.lr or use bf16/fp32"
        )
    return Trained(history, preds)


def ce_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, choice: AutocastChoice, backend: Backend
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One cross-entropy step (loss in FP32; a GradScaler for fp16), as teachers and scratch students train."""
    scaler = grad_scaler(backend, choice)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with choice.context(backend.device_type):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        return loss.detach()

    return step


# --------------------------------------------------------------------------- the protocol


ModelKey = tuple[str, tuple[int, ...], str, str]  # name, shape, precision, memory format


def _key(name: str, c: CellConfig) -> ModelKey:
    return name, tuple(c.data.shape), c.precision, c.memory_format


def _init_seed(seed: int, role: str) -> int:
    """Teachers and students of one seed start from different draws (2s + 1 and 2s)."""
    return 2 * seed + (1 if role == "teacher" else 0)


class _Run:
    def __init__(self, cfg: QualityConfig, backend: Backend, log: Callable[[str], Any], allow_imports: bool):
        self.cfg, self.backend, self.log = cfg, backend, log
        self.cache = ModelCache(allow_imports, capacity=64)
        self.datasets: dict[tuple[int, ...], Dataset] = {}
        self.on_device: dict[tuple[tuple[int, ...], str], _Data] = {}

    def data(self, c: CellConfig) -> _Data:
        shape = tuple(c.data.shape)
        if shape not in self.datasets:
            self.datasets[shape] = load_dataset(self.cfg, shape, seed=0)
        key = (shape, c.memory_format)
        if key not in self.on_device:
            d = self.datasets[shape]
            fmt = memory_format_of(c.memory_format)
            dev = self.backend.device
            self.on_device[key] = _Data(
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
                "teacher": TeacherConfig(mode="live"),
                "optimizer": self.cfg.optimizer_config(),
                "batch_size": self.cfg.batch_size,
                "world_size": 1,
                "seed": seed,
            }
        )

    def model(self, name: str, cell: CellConfig, role: str) -> nn.Module:
        init = cell.model_copy(update={"seed": _init_seed(cell.seed, role)})
        return _on_device(self.cache.get(name, init), cell, self.backend)

    def train_ce(self, name: str, cell: CellConfig, role: str, seed: int) -> Trained:
        model = self.model(name, cell, role)
        model.train()
        optimizer = make_optimizer(model.parameters(), cell.optimizer)
        choice = choose_autocast(self.backend, cell.precision)
        out = fit(
            ce_step(model, optimizer, choice, self.backend),
            model,
            optimizer,
            self.data(cell),
            self.cfg,
            self.backend,
            seed,
            choice,
        )
        if role == "teacher":
            out.model = model
        return out

    def distil(self, cell: CellConfig, teacher: Trained, seed: int) -> Trained:
        assert cell.pair is not None and teacher.model is not None
        data = self.data(cell)
        student = self.model(cell.pair.student, cell, "student")
        distiller = Distiller(copy.deepcopy(teacher.model), student, cell, self.backend, data.x_train[:2])
        try:
            return fit(
                distiller.train_step,
                distiller.student,
                distiller.optimizer,
                data,
                self.cfg,
                self.backend,
                seed,
                distiller.student_ac,
            )
        finally:
            for tap in (distiller.t_tap, distiller.trainee._tap[0]):
                if tap is not None:
                    tap.remove()

    def cleanup_after_failure(self) -> None:
        if self.backend.device_type == "cuda":
            torch.cuda.empty_cache()


def _row(
    role: str,
    teacher: str,
    student: str | None,
    method: str | None,
    seed: int,
    cfg: QualityConfig,
    precision: str,
    result: Trained | None = None,
    teacher_result: Trained | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(
        measurement="quality",
        status="ok" if error is None else "failed",
        error=error,
        quality_role=role,
        teacher=teacher,
        student=student,
        method=method,
        seed=seed,
        quality_dataset=cfg.dataset,
        quality_epochs=cfg.epochs,
        quality_target=cfg.target,
        batch_size=cfg.batch_size,
        precision=precision,
    )
    if result is not None:
        row.update(accuracy=result.accuracy, best_accuracy=result.best_accuracy, train_time_s=result.train_time_s)
        reference = result if role == "teacher" else teacher_result
        if reference is not None:
            seconds, epoch = result.reach(cfg.target * reference.accuracy)
            row.update(time_to_target_s=seconds, epochs_to_target=epoch)
            if role != "teacher":
                row["agreement"] = float((result.preds == reference.preds).float().mean())
    return row


def _describe(result: Trained, row: dict[str, Any]) -> str:
    text = f"top-1 {result.accuracy:.1%} (best {result.best_accuracy:.1%}), {result.train_time_s:.2f} s training"
    if row["agreement"] is not None:
        text += f", agreement {row['agreement']:.1%}"
    return text


def run_quality(
    cfg: QualityConfig,
    jobs: list[QualityJob],
    backend: Backend,
    log: Callable[[str], Any] = print,
    allow_imports: bool = False,
) -> list[dict[str, Any]]:
    """Train every job's teacher, scratch student and distilled student for each seed; one row per model and seed.

    Per seed: each distinct teacher (name, shape, precision, memory format) trains
    once and its trained weights serve every job with that teacher; each distinct
    student trains once from scratch (its row appears once per distinct pair, since
    agreement and time to target are measured against the pair's teacher); each job
    distils a fresh student.  A model that fails to build or train gives a failed row
    (and a failed teacher fails its distillations); the others still run.  Data-set
    errors (``KdbenchError``) are raised before anything trains.
    """
    run = _Run(cfg, backend, log, allow_imports)
    for job in jobs:
        run.data(job.config)  # load (and check) every data set first
    devices = [backend.device] if backend.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the caller's random state is left as it was
        return _run_seeds(run, cfg, jobs)


def _run_seeds(run: _Run, cfg: QualityConfig, jobs: list[QualityJob]) -> list[dict[str, Any]]:
    log = run.log
    rows: list[dict[str, Any]] = []
    for seed in range(cfg.seeds):
        teachers: dict[ModelKey, Trained | str] = {}
        scratch: dict[ModelKey, Trained | str] = {}
        cells = [run.cell(job.config, seed) for job in jobs]
        for cell in cells:  # teachers
            assert cell.pair is not None
            key = _key(cell.pair.teacher, cell)
            if key in teachers:
                continue
            try:
                teachers[key] = run.train_ce(cell.pair.teacher, cell, "teacher", seed)
                row = _row("teacher", cell.pair.teacher, None, None, seed, cfg, cell.precision, teachers[key])
                log(f"quality seed {seed}: teacher {cell.pair.teacher}: {_describe(teachers[key], row)}")
            except Exception as exc:
                run.cleanup_after_failure()
                teachers[key] = _error_text(exc)
                row = _row("teacher", cell.pair.teacher, None, None, seed, cfg, cell.precision, error=teachers[key])
                log(f"quality seed {seed}: teacher {cell.pair.teacher}: FAILED: {teachers[key]}")
            rows.append(row)
        for cell in cells:  # scratch students, trained once each
            assert cell.pair is not None
            key = _key(cell.pair.student, cell)
            if key in scratch:
                continue
            try:
                scratch[key] = run.train_ce(cell.pair.student, cell, "student", seed)
                log(
                    f"quality seed {seed}: scratch {cell.pair.student}: {_describe(scratch[key], dict(agreement=None))}"
                )  # type: ignore[arg-type]
            except Exception as exc:
                run.cleanup_after_failure()
                scratch[key] = _error_text(exc)
                log(f"quality seed {seed}: scratch {cell.pair.student}: FAILED: {scratch[key]}")
        done: set[tuple[ModelKey, ModelKey]] = set()
        for cell in cells:  # a scratch row per distinct pair
            assert cell.pair is not None
            t_key, s_key = _key(cell.pair.teacher, cell), _key(cell.pair.student, cell)
            if (t_key, s_key) in done:
                continue
            done.add((t_key, s_key))
            s, t = scratch[s_key], teachers[t_key]
            rows.append(
                _row(
                    "scratch",
                    cell.pair.teacher,
                    cell.pair.student,
                    None,
                    seed,
                    cfg,
                    cell.precision,
                    s if isinstance(s, Trained) else None,
                    t if isinstance(t, Trained) else None,
                    error=s if isinstance(s, str) else None,
                )
            )
        for cell in cells:  # distilled students
            assert cell.pair is not None
            names = (cell.pair.teacher, cell.pair.student, cell.method)
            label = f"{cell.method} {cell.pair.teacher}->{cell.pair.student}"
            t = teachers[_key(cell.pair.teacher, cell)]
            if isinstance(t, str):
                rows.append(
                    _row(
                        "distilled", *names, seed, cfg, cell.precision, error=f"the teacher failed to train: {t}"[:2000]
                    )
                )
                log(f"quality seed {seed}: distilled {label}: FAILED: the teacher failed to train")
                continue
            try:
                result = run.distil(cell, t, seed)
                row = _row("distilled", *names, seed, cfg, cell.precision, result, t)
                log(f"quality seed {seed}: distilled {label}: {_describe(result, row)}")
            except Exception as exc:
                run.cleanup_after_failure()
                row = _row("distilled", *names, seed, cfg, cell.precision, error=_error_text(exc))
                log(f"quality seed {seed}: distilled {label}: FAILED: {row['error']}")
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- summary


SUMMARY_KEYS = ("teacher", "student", "quality_role", "method")


def _stats(values: Any) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return math.nan, math.nan
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else math.nan


def summarize_quality(df: Any) -> Any:
    """Mean and std over seeds of each (teacher, student, quality_role, method), teachers first.

    Statistics use the ``ok`` rows: ``n`` of them (``failed``: the others).  Standard
    deviations are the sample ones (ddof=1), NaN for a single value.
    ``time_to_target_mean_s``/``_std_s`` are over the seeds that reached the target,
    ``reached`` of the ``n``.
    """
    import pandas as pd

    columns = [
        *SUMMARY_KEYS,
        "n",
        "failed",
        "accuracy_mean",
        "accuracy_std",
        "best_accuracy_mean",
        "agreement_mean",
        "agreement_std",
        "reached",
        "time_to_target_mean_s",
        "time_to_target_std_s",
        "epochs_to_target_mean",
        "train_time_mean_s",
    ]
    if "measurement" in df.columns:
        df = df[df["measurement"] == "quality"]
    if df.empty:
        return pd.DataFrame(columns=columns)
    out = []
    keys = df[list(SUMMARY_KEYS)].astype(object).where(df[list(SUMMARY_KEYS)].notna(), None)
    groups: dict[tuple, list[int]] = {}
    for i, k in zip(df.index, keys.itertuples(index=False, name=None)):
        groups.setdefault(k, []).append(i)
    for key, index in groups.items():
        g = df.loc[index]
        ok = g[g["status"] == "ok"]
        num = {
            c: pd.to_numeric(ok[c], errors="coerce")
            for c in ("accuracy", "best_accuracy", "agreement", "time_to_target_s", "epochs_to_target", "train_time_s")
        }
        acc_m, acc_s = _stats(num["accuracy"])
        agr_m, agr_s = _stats(num["agreement"])
        ttt_m, ttt_s = _stats(num["time_to_target_s"])
        out.append(
            {
                **dict(zip(SUMMARY_KEYS, key)),
                "n": len(ok),
                "failed": len(g) - len(ok),
                "accuracy_mean": acc_m,
                "accuracy_std": acc_s,
                "best_accuracy_mean": _stats(num["best_accuracy"])[0],
                "agreement_mean": agr_m,
                "agreement_std": agr_s,
                "reached": int(num["time_to_target_s"].notna().sum()),
                "time_to_target_mean_s": ttt_m,
                "time_to_target_std_s": ttt_s,
                "epochs_to_target_mean": _stats(num["epochs_to_target"])[0],
                "train_time_mean_s": _stats(num["train_time_s"])[0],
            }
        )
    summary = pd.DataFrame(out, columns=columns)
    order = summary["quality_role"].map({r: i for i, r in enumerate(ROLES)}).fillna(len(ROLES))
    summary = summary.assign(
        _order=order,
        _t=summary["teacher"].fillna(""),
        _s=summary["student"].fillna(""),
        _m=summary["method"].fillna(""),
    )
    summary = summary.sort_values(["_order", "_t", "_s", "_m"], kind="stable")
    return summary.drop(columns=["_order", "_t", "_s", "_m"]).reset_index(drop=True)


def mean_std(mean: float, std: float, scale: float = 1.0, digits: int = 1) -> str:
    """ "m ± s" (scaled, `digits` decimals); the mean alone when std is undefined; "–" when mean is."""
    if mean is None or not math.isfinite(mean):
        return "–"
    if std is None or not math.isfinite(std):
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def markdown_table(summary: Any) -> str:
    """A compact Markdown table of `summarize_quality`'s output (accuracies in %, times in s)."""
    lines = [
        "| teacher | student | model | method | top-1 (%) | agreement (%) | time to target (s) | reached |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary.to_dict("records"):

        def text(v: Any) -> str:
            return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)

        failed = f" ({r['failed']} failed)" if r.get("failed") else ""
        lines.append(
            f"| {text(r['teacher'])} | {text(r['student'])} | {r['quality_role']} | {text(r['method'])} | "
            f"{mean_std(r['accuracy_mean'], r['accuracy_std'], 100, 1)} | "
            f"{mean_std(r['agreement_mean'], r['agreement_std'], 100, 1)} | "
            f"{mean_std(r['time_to_target_mean_s'], r['time_to_target_std_s'], 1, 2)} | "
            f"{r['reached']}/{r['n']}{failed} |"
        )
    return "\n".join(lines) + "\n"
