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
import torch

import kdbench.measure.levers as levers
from kdbench.config.load import load_suite
from kdbench.core.errors import KdbenchError
from kdbench.measure.levers import tunableop_file
from kdbench.models import ModelCache
from kdbench.pytest_plugin import cell_of
from kdbench.workloads import expand_checked
from tests.support.helpers import simulated_gpu
from tests.support.paths import ROOT

EXAMPLE = ROOT / "examples" / "pytest" / "test_my_pair.py"
PAIR = {"teacher": "resnet20", "student": "resnet8"}


def _pytest(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A fresh pytest session; -o addopts="" keeps the repo's benchmark baseline and JSON options out of it.  One torch
    thread: these check what is recorded, not how fast, and a busy machine slows spinning threads most."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *args]
    # not an xdist worker's variables: pytest-benchmark turns itself off in a session it takes for an xdist worker
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_example_runs_under_plain_pytest(tmp_path):
    out = tmp_path / "out.json"
    # --kdbench-allow-unjudged: this checks what is recorded, whatever else the machine runs meanwhile
    proc = _pytest([str(EXAMPLE.relative_to(ROOT)), "--benchmark-json", str(out), "--kdbench-allow-unjudged"], ROOT)
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
    for cell in expand_checked(load_suite(ROOT / "suites" / "cpu.yaml")):
        again = cell_of(cell.config.model_dump(mode="json"))
        assert (again.cell_id, again.label) == (cell.cell_id, cell.label)
    # a user's module:callable (found, not imported, by the check)
    user = {"pair": {"teacher": "resnet20", "student": "tests.support.faulty_models:raising_rank1"}}
    assert cell_of(user).config.pair.student == "tests.support.faulty_models:raising_rank1"


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
        self.extra_info: dict = {}  # where the plugin records the host's load over the timing (contended)

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


# --------------------------------------------------------------------------- levers and runtimes

SMALL = {"pair": PAIR, "data": {"shape": [3, 16, 16], "num_classes": 10}, "batch_size": 4}


@pytest.mark.slow
def test_inference_is_served_by_the_cells_runtime_and_gpu_levers_skip_on_the_cpu(tmp_path):
    """One session: onnxruntime and int8 students are timed as `kdbench run` serves them (runtime and output check
    in extra_info), the teacher stays eager, a served student that disagrees with eager fails in one line, and
    GPU-only levers skip on the CPU with run's reason."""
    (tmp_path / "test_levers_user.py").write_text(
        textwrap.dedent(
            f"""
            import numpy as np
            import torch

            import kdbench.measure.runtimes as runtimes

            SMALL = {SMALL!r}
            INT8 = {{**SMALL, "inference": {{"runtime": "int8"}}}}

            def test_onnxruntime(kdbench):
                out = kdbench.inference({{**SMALL, "inference": {{"runtime": "onnxruntime"}}}}, device="cpu", rounds=2)
                assert isinstance(out, np.ndarray) and out.shape == (1, 10)  # ONNX Runtime's output, not torch's

            def test_int8(kdbench):
                out = kdbench.inference(INT8, device="cpu", rounds=2)
                assert isinstance(out, torch.Tensor) and out.shape == (1, 10)

            def test_teacher_is_eager(kdbench):
                kdbench.inference(INT8, model="teacher", device="cpu", rounds=2)

            def test_mismatch(kdbench, monkeypatch):
                wrong = runtimes.OutputCheck(max_abs_diff=3.0, top1_agreement=0.5, tolerance=1e-3, ok=False)
                monkeypatch.setattr(runtimes, "compare_outputs", lambda *args: wrong)
                kdbench.inference(INT8, device="cpu", rounds=2)

            def test_graphs_on_the_cpu(kdbench):
                kdbench.inference({{**SMALL, "graphs": True}}, device="cpu", rounds=2)

            def test_conv_autotune_on_the_cpu(kdbench):
                kdbench.step({{**SMALL, "conv_autotune": True}}, device="cpu", rounds=2)
            """
        )
    )
    out = tmp_path / "out.json"
    quiet = ["-W", "ignore::pytest_benchmark.logger.PytestBenchmarkWarning"]  # test_mismatch fails before timing
    proc = _pytest(["test_levers_user.py", "-rs", "--benchmark-json", str(out), *quiet], tmp_path)
    text = proc.stdout
    assert proc.returncode == 1, text + proc.stderr
    assert "1 failed, 3 passed, 2 skipped" in text, text
    lines = text.splitlines()
    mismatch = (
        "kdbench: the student served by int8 does not compute what eager does (MISMATCH: max |Δ| 3.0e+00 > "
        "1.0e-03, top-1 agreement 50 %); measure a runtime whose output agrees"
    )
    assert mismatch in lines, text
    assert "Traceback" not in text
    graphs = "kdbench: graphs: CUDA/HIP graphs capture GPU work: there is no graph to replay on the CPU"
    assert f"{graphs} (run it with --device cuda or rocm)" in text, text
    assert "kdbench: conv_autotune sets cudnn.benchmark, the cuDNN/MIOpen algorithm search: GPUs only" in text, text

    benchmarks = {b["name"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert sorted(benchmarks) == ["test_int8", "test_onnxruntime", "test_teacher_is_eager"]
    onnx, int8, teacher = (
        benchmarks[n]["extra_info"] for n in ("test_onnxruntime", "test_int8", "test_teacher_is_eager")
    )
    assert onnx["runtime"] == "onnxruntime" and onnx["one_off_kind"] == "ONNX export + session"
    assert int8["runtime"] == "int8" and int8["one_off_kind"] == "int8 quantization"
    for info in (onnx, int8):
        assert info["measurement"] == "student_inference" and info["model"] == "resnet8"
        assert info["one_off_ms"] > 0
        assert info["output_check"].startswith("ok: max |Δ| ") and "top-1 agreement" in info["output_check"]
        assert 0 <= info["output_max_abs_diff"] < 1 and 0 <= info["output_top1_agreement"] <= 1
    assert "onnxruntime " in onnx["notes"] and "CPUExecutionProvider" in onnx["notes"]
    assert "int8: dynamic quantization of 1 Linear layer" in int8["notes"]
    assert (teacher["measurement"], teacher["model"], teacher["runtime"]) == ("teacher_inference", "resnet20", "eager")
    assert "output_check" not in teacher and "one_off_ms" not in teacher


class _FakeTunable:
    """torch.cuda.tunable, recording its calls."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


class _RecordingBenchmark(_FakeBenchmark):
    """The fake benchmark, with extra_info and group, recording the device levers each timed call ran under."""

    group = None

    def __init__(self, events, tunable):
        super().__init__(events)
        self.extra_info = {}
        self.tunable = tunable

    def pedantic(self, target, rounds, warmup_rounds, iterations):
        self.events.append((torch.backends.cudnn.benchmark, ("enable", True) in self.tunable.calls))
        return super().pedantic(target, rounds, warmup_rounds, iterations)


@pytest.mark.parametrize("what", ["step", "inference"])
def test_device_levers_hold_around_the_benchmark_on_a_simulated_gpu(what, monkeypatch, tmp_path):
    """On a (simulated) GPU, step() and inference() time the call inside device_levers: cudnn.benchmark on
    for conv_autotune, TunableOp enabled with its file in the fixture's folder; both restored after."""
    import kdbench.hw.backends as backends
    import kdbench.hw.environment as environment
    from kdbench.pytest_plugin import KdbenchFixture

    gpu = simulated_gpu("cuda")
    tunable = _FakeTunable()
    monkeypatch.setattr(backends, "resolve", lambda requested: gpu)
    monkeypatch.setattr(environment, "device_facts", lambda backend: {"device_name": "simulated"})
    monkeypatch.setattr(torch.cuda, "tunable", tunable, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    entered = []
    real = levers.device_levers

    def watched(config, backend, tunable_path=None):
        entered.append((config.conv_autotune, config.tunableop, backend.device_type, tunable_path))
        return real(config, backend, tunable_path)

    monkeypatch.setattr(levers, "device_levers", watched)
    events: list = []
    bench = _RecordingBenchmark(events, tunable)
    fixture = KdbenchFixture(bench, cache=ModelCache, tunable_dir=lambda: tmp_path / "kdbench")
    config = {**SMALL, "conv_autotune": True, "tunableop": True}
    getattr(fixture, what)(config, device="cuda", rounds=2, warmup_rounds=1)
    fixture.close()

    path = tunableop_file(str(tmp_path / "kdbench"), "cuda")  # a simulated GPU has no name: the backend's
    assert path == tmp_path / "kdbench" / "_tunableop-cuda.csv"
    assert entered == [(True, True, "cuda", path)]
    assert events[0] == (True, True)  # timed with cudnn.benchmark on and TunableOp enabled
    assert events.count("timing") == 1
    assert tunable.calls == [
        ("set_filename", str(path)),
        ("enable", True),
        ("tuning_enable", True),
        ("tuning_enable", False),
        ("enable", False),
        ("write_file",),
    ]
    assert "TunableOp tunes GEMMs only" in bench.extra_info["notes"]
    assert torch.backends.cudnn.benchmark is False  # restored
    assert bench.extra_info["tunableop_file"] == str(path)
    assert bench.extra_info["backend"] == "cuda" and bench.extra_info["device_name"] == "simulated"
    assert bench.extra_info["measurement"] == ("distill_step" if what == "step" else "student_inference")


def test_no_device_levers_without_them_on_a_simulated_gpu(monkeypatch):
    """conv_autotune off is set, not inherited (as `kdbench run`): cudnn.benchmark is off for the timed call."""
    import kdbench.hw.backends as backends
    import kdbench.hw.environment as environment
    from kdbench.pytest_plugin import KdbenchFixture

    monkeypatch.setattr(backends, "resolve", lambda requested: simulated_gpu("cuda"))
    monkeypatch.setattr(environment, "device_facts", lambda backend: {"device_name": "simulated"})
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    tunable = _FakeTunable()
    monkeypatch.setattr(torch.cuda, "tunable", tunable, raising=False)
    events: list = []
    bench = _RecordingBenchmark(events, tunable)
    KdbenchFixture(bench, cache=ModelCache).inference(SMALL, device="cuda", rounds=1, warmup_rounds=0)
    assert events[0] == (False, False) and tunable.calls == []
    assert torch.backends.cudnn.benchmark is True and "tunableop_file" not in bench.extra_info
