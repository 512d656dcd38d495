"""benchmarks/gpu_check.py is run by hand on a GPU; what of it means something on the CPU runs here,
so the script cannot rot unnoticed between GPU sessions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kdbench.hw.backends import resolve

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pytest_does_not_collect_the_gpu_check(pytestconfig):
    patterns = pytestconfig.getini("python_files")
    assert not any(Path(SCRIPT.name).match(p) for p in patterns)


def test_math_check_passes_on_the_cpu_and_skips_tf32_with_its_reason(gpu_check, capsys):
    report = gpu_check.Report()
    gpu_check.check_math(resolve("cpu"), report)
    out = capsys.readouterr().out
    assert report.failed == []
    assert report.passed == 5  # fp32, tf32 (skipped, as it should be), bf16, fp16, and the fp32 error
    assert "tf32: skipped here: tf32 is a GPU math mode" in out
    assert "fp32 matmul error" in out


def test_a_failed_check_is_kept_and_printed(gpu_check, capsys):
    report = gpu_check.Report()
    assert report.check("one thing", True) is True
    assert report.check("another", False) is False
    assert report.passed == 1 and report.failed == ["another"]
    assert "FAIL another" in capsys.readouterr().out


def test_checks_that_need_a_gpu_say_so_on_the_cpu(gpu_check, capsys):
    report = gpu_check.Report()
    gpu_check.check_telemetry(resolve("cpu"), report)
    gpu_check.check_memory(resolve("cpu"), report)
    assert report.passed == 0 and report.failed == []
    assert capsys.readouterr().out.count("no GPU") == 2
