"""Benchmark your own teacher/student pair with pytest-benchmark, measured as `kdbench run` measures it.

Needs kdbench with its test extras (pytest, pytest-benchmark): ``pip install -e ".[test]"``.
Installing kdbench registers the ``kdbench`` fixture in every pytest session; nothing to import.

    pytest examples/pytest/test_my_pair.py                                  # a table of timings
    pytest examples/pytest/test_my_pair.py --benchmark-json=bench.json      # ... and the numbers, with extra_info
    pytest examples/pytest/test_my_pair.py --benchmark-storage=my-baselines --benchmark-save=mine   # store a run
    pytest examples/pytest/test_my_pair.py --benchmark-storage=my-baselines --benchmark-compare \
        --benchmark-compare-fail=median:10%
        # compare with the newest run saved there; fail the session (exit 1) when a median got >10% slower (CI)
    (inside this repository the default storage is benchmarks/baseline/, the committed baseline: give your own)

Each test measures ONE thing (pytest-benchmark times one callable per test):
``kdbench.step(config)`` a distillation step, ``kdbench.inference(config, batch_size=...)`` a forward.
``config`` has the keys of a suite's ``defaults`` (see suites/cpu.yaml); unknown or invalid keys fail
the test with kdbench's one-line message.  ``device="auto"`` is the GPU when there is one, else the CPU.
"""

from __future__ import annotations

import math

from torch import nn

# resnet20 -> resnet8: a tiny CIFAR pair (`python -m kdbench list models` shows every name).
# To benchmark YOUR models, give "module:callable" instead of a name, e.g.
#     "pair": {"teacher": "mypkg.models:big_net", "student": "mypkg.models:small_net"}
# The callable is called with the keyword arguments it accepts among num_classes and in_shape
# (one sample's shape, e.g. (3, 32, 32)) and must return a torch.nn.Module.  The module must be
# importable (installed, or its folder on PYTHONPATH).  test_own_student below uses a model
# defined in this file.
CELL = {
    "pair": {"teacher": "resnet20", "student": "resnet8"},
    "method": "kd",  # also dkd, fitnet, at, or a combination such as "kd+at" (`kdbench list methods`)
    "kd": {"temperature": 4.0, "alpha": 0.9},
    "precision": "fp32",  # bf16 / fp16 run under autocast (fp16 only on GPUs: it is very slow on CPUs)
    "batch_size": 16,
    "data": {"shape": [3, 32, 32], "num_classes": 100},
    "optimizer": {"name": "adamw", "lr": 1.0e-4},
}

# Rounds of one call each, after 3 untimed warm-up calls.  Small to keep this example quick; use more
# (or rounds=None: pytest-benchmark then picks them from --benchmark-min-rounds/--benchmark-max-time)
# for numbers stable enough to gate CI on.
ROUNDS = 10


def test_distill_step(kdbench):
    """One distillation step: frozen teacher forward, student forward, KD loss, backward, AdamW update."""
    loss = kdbench.step(CELL, device="auto", rounds=ROUNDS)
    assert math.isfinite(loss)


def test_student_inference(kdbench):
    """The student's forward at batch 1 (eval(), inference_mode, the cell's precision): serving latency.
    model="teacher" measures the teacher's instead."""
    logits = kdbench.inference(CELL, batch_size=1, model="student", device="auto", rounds=5 * ROUNDS)
    assert logits.shape == (1, 100)


def small_cnn(num_classes: int, in_shape: tuple[int, ...]) -> nn.Module:
    """A user's own student: any factory returning an nn.Module works."""
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


def test_own_student(kdbench):
    """The same step with the student defined above, named as "module:callable"."""
    own = {**CELL, "pair": {"teacher": "resnet20", "student": f"{__name__}:small_cnn"}}
    loss = kdbench.step(own, device="auto", rounds=ROUNDS)
    assert math.isfinite(loss)
