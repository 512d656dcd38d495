"""The quality data sets, loaded into memory as standardised image tensors.

``digits`` is scikit-learn's 1797 8x8 handwritten digits, shipped with the package
(nothing is downloaded).  Images on disk are read with torchvision
(``download=False``): ``imagefolder``, ``cifar10``, ``cifar100`` under ``quality.root``.
Everything is held in memory as float32 ``(N, C, H, W)``, resized to the cells'
``data.shape`` and standardised with the training split's per-channel mean and std.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kdbench.config.quality import DISK_DATASETS, QualityConfig
from kdbench.core.errors import KdbenchError


class Dataset(NamedTuple):
    x_train: torch.Tensor  # float32 (N, C, H, W), standardised
    y_train: torch.Tensor  # int64 (N,)
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int


def image_shape(shape: Iterable[int]) -> tuple[int, int, int]:
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
    image = image_shape(shape)
    if cfg.dataset in DISK_DATASETS and not cfg.root:
        raise KdbenchError(f"quality.root is required for dataset {cfg.dataset}; set it to the data set's folder")
    loader = {"digits": _digits, "imagefolder": _imagefolder, "cifar10": _cifar, "cifar100": _cifar}[cfg.dataset]
    x_tr, y_tr, x_te, y_te, num_classes = loader(cfg, image, seed)
    x_tr, x_te = _standardise(x_tr.float(), x_te.float())
    return Dataset(x_tr, y_tr.long(), x_te, y_te.long(), int(num_classes))
