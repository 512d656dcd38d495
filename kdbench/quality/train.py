"""Training on real data: the loop every quality model follows, and its test record.

:func:`fit` runs ``cfg.epochs`` epochs of a step function over shuffled mini-batches
with a cosine learning-rate schedule, evaluating the test split after every epoch (not
counted as training time).  Training drops each epoch's last incomplete mini-batch
(batch norm cannot train on a batch of one); the shuffling changes which samples those
are every epoch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kdbench.config.schema import QualityConfig
from kdbench.distill.losses.registry import training_epoch
from kdbench.distill.step import backward_and_update
from kdbench.hw.backends import AutocastChoice, Backend, grad_scaler

EVAL_BATCH = 512


@dataclass
class Trained:
    """A trained model's test record; `model` kept for teachers only."""

    history: list[tuple[float, float]]  # (training seconds so far, test accuracy) after each epoch
    preds: torch.Tensor  # test predictions after the last epoch (CPU)
    model: nn.Module | None = None
    test_losses: list[float] = field(default_factory=list)  # the test loss after each epoch, where one is measured

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
) -> Trained:
    """`cfg.epochs` epochs of `step(x, y, indices)` over mini-batches shuffled by a generator seeded with `seed`.

    A cosine schedule anneals `optimizer`'s learning rate over all steps.  Only the
    steps are timed; the evaluation after each epoch is not.  The steps of epoch e
    (1-based) run inside ``training_epoch(e)``: the loss terms that count epochs see it.
    ``evaluate`` replaces the top-1 evaluation of a classifier (the text protocol's next-byte one,
    which also measures the test loss).
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
    model: nn.Module, optimizer: torch.optim.Optimizer, choice: AutocastChoice, backend: Backend
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One cross-entropy step (loss in FP32; a GradScaler for fp16), as teachers and scratch students train."""
    scaler = grad_scaler(backend, choice)

    def step(x: torch.Tensor, y: torch.Tensor, _indices: torch.Tensor | None = None) -> torch.Tensor:
        with choice.context(backend.device_type):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        optimizer.zero_grad(set_to_none=True)
        backward_and_update(loss, optimizer, scaler)
        return loss.detach()

    return step
