"""One distillation step: frozen teacher forward, student forward, loss, backward, update."""

from __future__ import annotations

import torch
from torch import nn

from kdbench.backends import AutocastChoice, Backend, choose_autocast, grad_scaler
from kdbench.distill.losses import check_method
from kdbench.layout import unpad
from kdbench.suite import CellConfig, OptimizerConfig


def make_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    kwargs = {} if cfg.weight_decay is None else {"weight_decay": cfg.weight_decay}
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, **kwargs)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, **kwargs)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, **kwargs)


def freeze(teacher: nn.Module) -> nn.Module:
    """eval() (batch-norm statistics stay put) and no gradients; no optimizer ever sees it."""
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


class DistillStep:
    """Callable that performs one full step on a fixed batch.

    The loss of the last call is kept as a tensor (`last_loss`), so the timed loop
    never waits on the device to read it.
    """

    def __init__(self, teacher: nn.Module, student: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 config: CellConfig, backend: Backend):
        self.teacher = freeze(teacher)
        self.student = student.train()
        self.x, self.y = x, y
        self.config = config
        self.method = check_method(config.method)
        self.optimizer = make_optimizer(student.parameters(), config.optimizer)
        self.student_ac: AutocastChoice = choose_autocast(backend, config.precision)
        self.teacher_ac: AutocastChoice = choose_autocast(backend, config.teacher_precision)
        self.scaler = grad_scaler(backend, self.student_ac)
        self.device_type = backend.device_type
        self.last_loss: torch.Tensor | None = None

    def __call__(self) -> None:
        with torch.inference_mode(), self.teacher_ac.context(self.device_type):
            t_logits = self.teacher(self.x)
        with self.student_ac.context(self.device_type):
            s_logits = self.student(self.x)
        n = self.config.data.num_classes  # a padded classifier's extra columns stay out of the loss
        loss = self.method.fn(unpad(s_logits, n), unpad(t_logits, n), self.y, self.config)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.last_loss = loss.detach()
