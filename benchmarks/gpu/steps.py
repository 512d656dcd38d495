"""The cells the checks build by hand (the syncs, memory and phases stages): a CIFAR vision cell and the syncs
stage's tiny-Llama cell, and their distillation step built as ``kdbench run`` builds it — through the cell's
workload, its models from the seeded model cache (padded and placed as the cell says) and its batch from the
cell's seed — so that a figure measured here is one a cell would measure (review 5 §2.7: the vision step was
built apart, and could drift)."""

from __future__ import annotations

import torch

from kdbench.config.schema import CellConfig
from kdbench.distill.step import DistillStep
from kdbench.hw.backends import Backend
from kdbench.models import ModelCache
from kdbench.workloads import workload_of


def vision_config(**changes) -> CellConfig:
    """A CIFAR cell (resnet56->resnet20 kd+at, batch 128, short timing), with ``changes`` over it."""
    base = {
        "pair": {"teacher": "resnet56", "student": "resnet20"},
        "method": "kd+at",
        "batch_size": 128,
        "data": {"shape": [3, 32, 32], "num_classes": 100},
        "timing": {"warmup": 3, "min_iters": 10, "min_time_s": 0.3},
        "inference": {"batch_sizes": [128]},
    }
    return CellConfig.model_validate({**base, **changes})


def lm_config(**changes) -> CellConfig:
    """The syncs stage's LM cell: the tiny Llama pair, bf16, 32k vocabulary, 2 x 256 tokens."""
    base = {
        "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        "overrides": {"teacher": {"vocab_size": 32000}, "student": {"vocab_size": 32000}},
        "data": {"kind": "tokens", "seq_len": 256, "prompt_fraction": 0.25},
        "method": "forward_kl",
        "precision": "bf16",
        "teacher_precision": "bf16",
        "batch_size": 2,
        "chunk_size": 256,
        "inference": {"batch_sizes": []},
    }
    return CellConfig.model_validate({**base, **changes})


def cell_step(backend: Backend, config: CellConfig) -> DistillStep:
    """The distillation step of a cell of any family, built as a cell builds it (its workload's pair and batch)."""
    workload = workload_of(config)
    torch.manual_seed(0)
    teacher, student = workload.build_pair(config, backend, ModelCache())
    x, y = workload.batch(config, config.batch_size, backend.device, config.seed, (teacher, student))
    return DistillStep(teacher, student, x, y, config, backend, workload)
