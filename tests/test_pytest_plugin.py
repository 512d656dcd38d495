"""The pytest plugin (kdbench/pytest_plugin.py): the example test file under plain pytest, a plugin that
costs nothing in sessions that do not use it, and one-line failures for bad configs."""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kdbench.config.load import load_suite
from kdbench.config.plan import expand
from kdbench.errors import KdbenchError
from kdbench.pytest_plugin import cell_of

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pytest" / "test_my_pair.py"
PAIR = {"teacher": "resnet20", "student": "resnet8"}


def _pytest(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A fresh pytest session; -o addopts="" keeps the repo's benchmark baseline and JSON options out of it.  One torch
    thread: these check what is recorded, not how fast, and a busy machine slows spinning threads most."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_example_runs_under_plain_pytest(tmp_path):
    out = tmp_path / "out.json"
    proc = _pytest([str(EXAMPLE.relative_to(ROOT)), "--benchmark-json", str(out)], ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tests = [n.name for n in ast.parse(EXAMPLE.read_text()).body if isinstance(n, ast.FunctionDef)]
    tests = [t for t in tests if t.startswith("test_")]
    benchmarks = {b["name"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert sorted(benchmarks) == sorted(tests)  # one benchmark per example test
    for name, b in benchmarks.items():
        info = b["extra_info"]
        assert b["stats"]["median"] > 0, name
        assert len(info["cell_id"]) == 16 and info["cell"].startswith("resnet20->"), info
        assert info["precision"] == "fp32" and info["backend"] in ("cpu", "cuda", "rocm")
        assert info["device_name"]
        assert b["group"] == info["measurement"]
    assert benchmarks["test_distill_step"]["extra_info"]["measurement"] == "distill_step"
    assert benchmarks["test_distill_step"]["extra_info"]["batch_size"] == 16
    inference = benchmarks["test_student_inference"]["extra_info"]
    assert (inference["measurement"], inference["batch_size"], inference["model"]) == (
        "student_inference",
        1,
        "resnet8",
    )


def test_plugin_imports_nothing_heavy():
    code = "import sys, kdbench.pytest_plugin; assert 'torch' not in sys.modules, sorted(sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_bad_config_fails_in_one_line(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            f"""
            import sys

            PAIR = {PAIR!r}

            def test_untouched():  # a test without the fixture: the plugin has imported nothing
                assert "torch" not in sys.modules

            def test_bad_batch(kdbench):
                kdbench.step({{"pair": PAIR, "batch_size": 0}})

            def test_typo(kdbench):
                kdbench.inference({{"pair": PAIR, "precison": "bf16"}})

            def test_tf32_on_cpu(kdbench):  # skipped, as `kdbench run` stores the cell as skipped
                kdbench.step({{"pair": PAIR, "precision": "tf32"}}, device="cpu")
            """
        )
    )
    proc = _pytest(["test_user.py", "-rs", "-W", "ignore::pytest_benchmark.logger.PytestBenchmarkWarning"], tmp_path)
    text = proc.stdout
    assert proc.returncode == 1, text + proc.stderr
    assert "2 failed, 1 passed, 1 skipped" in text, text
    lines = text.splitlines()
    assert "kdbench: config: defaults.batch_size: input should be greater than or equal to 1 (got 0)" in lines
    assert "kdbench: config: defaults.precison: unknown key 'precison'; did you mean 'precision'?" in lines
    assert "kdbench.step(" not in text and "Traceback" not in text  # the message alone, no traceback
    assert "kdbench: tf32 is a GPU math mode" in text


def test_cell_of_matches_kdbench_run():
    """A config dict gives the cell (and cell_id) `kdbench run` gives the same settings in a suite."""
    for cell in expand(load_suite(ROOT / "suites" / "cpu.yaml")):
        again = cell_of(cell.config.model_dump(mode="json"))
        assert (again.cell_id, again.label) == (cell.cell_id, cell.label)
    assert cell_of({"pair": {"teacher": "resnet20", "student": "mine:net"}}).config.pair.student == "mine:net"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"pair": PAIR, "world_size": 2}, "world_size 2: the kdbench fixture measures one device"),
        ({"pair": {"teacher": "resnet20", "student": "resnt8"}}, "unknown model 'resnt8'"),
        ({"batch_size": 8}, "no teacher/student pair"),
        ([("pair", PAIR)], "config must be a dict"),
    ],
)
def test_cell_of_refuses(config, message):
    with pytest.raises(KdbenchError, match=message):
        cell_of(config)


class _FakeBenchmark:
    """pytest-benchmark's fixture, reduced to what the plugin calls."""

    enabled = True

    def __init__(self, events: list[str]):
        self.events = events

    def pedantic(self, target, rounds, warmup_rounds, iterations):
        assert iterations == 1
        self.events.append("timing")
        return [target() for _ in range(warmup_rounds + rounds)][-1]

    def __call__(self, target):
        self.events.append("timing")
        return [target() for _ in range(4)][-1]


@pytest.mark.parametrize("rounds", [2, None])
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_gpu_calls_end_with_a_synchronize(device_type, rounds):
    """On GPUs every timed (and warm-up) call is followed by a device synchronize, and the device is
    synchronized before the first: host time per call is device time.  No GPU needed: a stand-in backend."""
    from types import SimpleNamespace

    from kdbench.pytest_plugin import KdbenchFixture

    events: list[str] = []
    sync = (lambda: events.append("sync")) if device_type == "cuda" else (lambda: None)
    backend = SimpleNamespace(device_type=device_type, synchronize=sync)
    fixture = KdbenchFixture(_FakeBenchmark(events), cache=lambda: None)
    out = fixture._run(lambda: events.append("call") or "out", backend, rounds=rounds, warmup_rounds=1)
    assert out == "out"
    calls = events.count("call")
    assert calls == (3 if rounds else 5)  # 1 warm-up + rounds (pedantic), or 1 warm-up + 4 (benchmark(...))
    if device_type == "cuda":
        assert events[0] == "sync" and events.count("sync") == calls + 1
        assert all(b == "sync" for a, b in itertools.pairwise(events) if a == "call")
    else:
        assert "sync" not in events
