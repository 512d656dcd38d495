"""Print what the benchmarks measured at the end of the pytest run (not only under -s)."""

import pytest
import torch

from kdbench.config.schema import CellConfig
from kdbench.data.synthetic import synthetic_batch
from kdbench.distill.step import DistillStep
from kdbench.hw.backends import resolve
from kdbench.models import build_model
from kdbench.workloads.vision import VISION

_LINES: list[str] = []


@pytest.fixture
def report_line():
    """Call with a line of text to have it printed in the run's closing summary."""
    return _LINES.append


@pytest.fixture
def cpu_step():
    """`cpu_step(method)`: a resnet20 -> resnet8 step on a fixed CIFAR-shaped batch of 16 on the CPU,
    and its backend; the step the benchmarks measure."""

    def make(method: str = "kd"):
        config = CellConfig.model_validate(
            {
                "pair": {"teacher": "resnet20", "student": "resnet8"},
                "batch_size": 16,
                "method": method,
                "data": {"shape": [3, 32, 32], "num_classes": 100},
            }
        )
        backend = resolve("cpu")
        torch.manual_seed(0)
        teacher = build_model("resnet20", 100, (3, 32, 32))
        student = build_model("resnet8", 100, (3, 32, 32))
        x, y = synthetic_batch(config, config.batch_size, backend.device, 0)
        return DistillStep(teacher, student, x, y, config, backend, VISION), backend

    return make


@pytest.fixture
def cpu_lm_step():
    """`cpu_lm_step(seq_len)`: the LM step the fidelity benchmark measures on the CPU, and its backend: the
    registered tiny Llama pair at a 32,000 vocabulary (built by the LM workload from the cell's seed), 2 sequences
    of `seq_len` tokens with their first quarter the prompt, forward KL (alpha 0.5: + CE), fp32, AdamW, dense."""

    def make(seq_len: int = 512, loss_impl: str = "dense"):
        from kdbench.models import ModelCache
        from kdbench.workloads.lm.workload import LM

        config = CellConfig.model_validate(
            {
                "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
                "overrides": {"teacher": {"vocab_size": 32000}, "student": {"vocab_size": 32000}},
                "data": {"kind": "tokens", "seq_len": seq_len},
                "method": "forward_kl",
                "batch_size": 2,
                "loss_impl": loss_impl,
            }
        )
        backend = resolve("cpu")
        teacher, student = LM.build_pair(config, backend, ModelCache())
        x, y = LM.batch(config, config.batch_size, backend.device, config.seed, (teacher, student))
        return DistillStep(teacher, student, x, y, config, backend, LM), backend

    return make


def pytest_terminal_summary(terminalreporter):
    if _LINES:
        terminalreporter.section("kdbench benchmarks")
        for line in _LINES:
            terminalreporter.write_line(line)
