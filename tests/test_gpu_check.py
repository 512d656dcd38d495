"""benchmarks/gpu_check.py is run by hand on a GPU; what of it means something on the CPU runs here,
so the script cannot rot unnoticed between GPU sessions."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdbench.hw.backends import resolve

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_cpu_run(gpu_check, tmp_path_factory):
    """One `--device cpu --quick` run for the tests that read what it wrote."""
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    start = time.perf_counter()
    code = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)])
    return code, out, time.perf_counter() - start


def test_pytest_does_not_collect_the_gpu_check(pytestconfig):
    patterns = pytestconfig.getini("python_files")
    assert not any(Path(SCRIPT.name).match(p) for p in patterns)


def test_math_check_passes_on_the_cpu_and_skips_tf32_with_its_reason(gpu_check, capsys):
    report = gpu_check.Report()
    gpu_check.check_math(resolve("cpu"), report)
    out = capsys.readouterr().out
    assert report.failed == []
    # fp32, tf32 (skipped, as it should be), bf16, fp16, the flag getters in IEEE and in TF32, the fp32 error
    assert report.passed == 7
    assert "tf32: skipped here: tf32 is a GPU math mode" in out
    assert "fp32 matmul error" in out


def test_the_flag_getters_answer_inside_math_mode_and_agree_with_it(gpu_check):
    # gpu-review-2 G2: on torch >= 2.9 a legacy getter may raise inside math_mode; torch's compiler reads them
    for tf32 in (False, True):
        found = gpu_check.flag_getters(tf32)
        names = [name for name, *_ in found]
        assert {"cudnn.allow_tf32", "cuda.matmul.allow_tf32", "get_float32_matmul_precision()"} <= set(names)
        wrong = [(name, value) for name, value, ok in found if not ok]
        assert wrong == [], f"math_mode({tf32}): {wrong}"


def test_a_raising_getter_is_a_failed_check_with_its_text(gpu_check, monkeypatch, capsys):
    def broken():
        raise RuntimeError("PyTorch is checking whether allow_tf32 is enabled")

    monkeypatch.setattr(gpu_check, "FLAG_GETTERS", (("cudnn.allow_tf32", broken, False),))
    report = gpu_check.Report()
    gpu_check.check_flag_getters(report)
    assert len(report.failed) == 2
    assert "raised RuntimeError: PyTorch is checking whether allow_tf32 is enabled (WRONG)" in capsys.readouterr().out


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


def test_the_new_gpu_checks_say_so_on_the_cpu(gpu_check, tmp_path, capsys):
    report = gpu_check.Report()
    cpu = resolve("cpu")
    gpu_check.check_idle(cpu, report)
    gpu_check.check_syncs(cpu, report)
    gpu_check.check_levers(cpu, gpu_check.LEVERS, tmp_path, report, 240)
    assert report.passed == 0 and report.failed == []
    out = capsys.readouterr().out
    assert out.count("no GPU") == 3
    assert "no GPU: the levers suite needs one" in out


def test_the_plan_fits_one_device_command_and_quick_fits_with_margin(gpu_check):
    full = gpu_check.parse_args([])
    quick = gpu_check.parse_args(["--quick"])
    names = [name for name, *_ in gpu_check.plan(full)]
    assert names[0] == "start-up" and {"levers", "syncs", "idle", "math", "suite", "report"} <= set(names)
    low, high = gpu_check.plan_bounds(full)
    assert 0 < low <= high <= 480  # 8 minutes of a 10-minute device command
    assert gpu_check.plan_bounds(quick)[1] < high
    assert gpu_check.plan_bounds(gpu_check.parse_args(["--skip", "levers"]))[1] == high - 240
    assert gpu_check.parse_args([]).cell_timeout == 240


def test_quick_suites_are_subsets_with_the_cells_the_summary_reads(gpu_check, tmp_path):
    from kdbench.config.load import load_suite
    from kdbench.workloads import expand_checked

    smoke = gpu_check.subset_suite(gpu_check.SMOKE, gpu_check.quick_smoke_case, tmp_path, "gpu-smoke-quick")
    levers = gpu_check.subset_suite(gpu_check.LEVERS, gpu_check.quick_lever_case, tmp_path, "gpu-levers-quick")
    full_smoke = {c.cell_id for c in expand_checked(load_suite(gpu_check.SMOKE))}
    full_levers = {c.cell_id: c.config for c in expand_checked(load_suite(gpu_check.LEVERS))}
    quick_smoke = [c.config for c in expand_checked(load_suite(smoke)) if c.cell_id in full_smoke]
    quick_levers = [c.config for c in expand_checked(load_suite(levers)) if c.cell_id in full_levers]
    assert len(quick_smoke) == 3 and len(quick_levers) == 7  # the same cells (same ids) as in the full suites
    assert any(c.pair.student == "resnet18" and c.precision == "bf16" for c in quick_smoke)
    assert [c.compile for c in quick_levers if c.compile != "off"] == ["reduce-overhead"]
    assert any(c.compile_teacher for c in quick_levers)


def test_the_levers_suite_plans_every_lever_once():
    done = subprocess.run(
        [sys.executable, "-m", "kdbench", "run", "suites/gpu-levers.yaml", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "10 cells, 20 measurements" in done.stdout
    for label in ("compile-default", "compile-reduce-overhead compile-teacher", "graphs", "serve-compile"):
        assert label in done.stdout
    for label in ("conv-autotune", "tunableop", "fused", "fp32 bs64 serve-onnxruntime"):
        assert label in done.stdout


def test_quick_runs_on_the_cpu_and_the_gpu_stages_say_no_gpu(quick_cpu_run):
    code, out, seconds = quick_cpu_run
    log = (out / "check.log").read_text()
    assert code == 0, log
    assert seconds < 120
    for line in (
        "no GPU: the levers suite needs one",
        "no GPU: nothing synchronises on the CPU",
        "no GPU: the host clock times the sleep",
        "no GPU: the CPU has no allocator counters",
        "no GPU: --quick on the CPU skips the suite stage",
    ):
        assert line in log
    assert "plan (--quick): seconds on a warm H200" in log
    assert "ok   kdbench probe exit code 0" in log  # the subprocess's output is in the log too
    assert "probing cpu" in log


def test_quick_output_is_a_few_files_at_most_two_folders_deep(quick_cpu_run):
    _, out, _ = quick_cpu_run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8
    assert all(len(p.relative_to(out).parts) <= 2 for p in out.rglob("*"))
    assert {"summary.txt", "check.log", "results.tar.gz", "probe.parquet"} <= {p.name for p in files}


def test_summary_reports_the_five_numbers_and_the_counts(quick_cpu_run):
    _, out, _ = quick_cpu_run
    summary = (out / "summary.txt").read_text()
    assert "passed, 0 failed" in summary and "torch " in summary and "UTC" in summary and "wall time" in summary
    for number in range(1, 6):
        assert f"\n  {number}. " in summary
    assert "probe bf16 matmul, TFLOP/s:" in summary and "INFO: no expected range for cpu" in summary
    assert "5. energy counter over sampled power, GEMM window: n/a: " in summary


def test_first_run_numbers_are_judged_against_the_h200_ranges(gpu_check):
    report = gpu_check.Report()
    report.figure("probe_bf16_tflops", 781.0)
    report.figure("energy_ratio", 1.4)
    report.figure("clock_adds_launch_bound", True)
    fig = {f.key: f for f in gpu_check.FIGURES}
    assert gpu_check.judge(fig["probe_bf16_tflops"], report, "NVIDIA H200", {}).endswith("PASS")
    assert gpu_check.judge(fig["energy_ratio"], report, "NVIDIA H200", {}).endswith("FAIL")
    assert gpu_check.judge(fig["clock_adds_launch_bound"], report, "NVIDIA H200", {}).endswith("PASS")
    assert "INFO: no expected range for NVIDIA A100" in gpu_check.judge(
        fig["probe_bf16_tflops"], report, "NVIDIA A100", {}
    )
    assert "n/a: the telemetry stage skipped" in gpu_check.judge(
        fig["energy_ratio"], gpu_check.Report(), "x", {"telemetry": "skipped"}
    )


def test_a_stopped_run_still_leaves_its_summary_and_log(gpu_check, monkeypatch, tmp_path):
    def stopped(*args, **kwargs):
        raise gpu_check.Stopped("stopped by SIGTERM")

    monkeypatch.setattr(gpu_check, "check_idle", stopped)
    out = tmp_path / "out"
    code = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), "--skip", "probe"])
    assert code == 1
    summary = (out / "summary.txt").read_text()
    assert "stopped by SIGTERM" in summary and "idle stopped by SIGTERM" in summary
    assert "math done" in summary and "syncs not reached" in summary
    assert "FAIL idle: stopped by SIGTERM" in (out / "check.log").read_text()


def test_lever_rows_pass_ok_or_skipped_with_a_reason_and_compiled_rows_need_a_one_off_cost(gpu_check, monkeypatch):
    import types

    import pandas as pd

    base = {"batch_size": 64, "median_ms": 1.0, "compile": "off", "compile_teacher": False, "runtime": None}
    base |= {"one_off_ms": None, "one_off_kind": None, "compiled_graphs": 1, "graph_breaks": 0, "recompiles": 0}
    base |= {"output_check": None, "error": None}
    rows = [
        {"cell_label": "plain", "measurement": "distill_step", "status": "ok"},
        {"cell_label": "co", "measurement": "distill_step", "status": "ok", "compile": "default", "one_off_ms": 2e4},
        {"cell_label": "free", "measurement": "distill_step", "status": "ok", "compile": "default", "one_off_ms": 0.0},
        {"cell_label": "teach", "measurement": "distill_step", "status": "ok", "compile_teacher": True},
        {"cell_label": "serve", "measurement": "student_inference", "status": "ok", "runtime": "compile + graphs"},
        {"cell_label": "ort", "measurement": "student_inference", "status": "skipped", "error": "no onnxruntime-gpu"},
        {"cell_label": "why", "measurement": "student_inference", "status": "skipped"},
        {"cell_label": "crash", "measurement": "distill_step", "status": "failed", "error": "overwritten"},
        {"cell_label": "ort2", "measurement": "student_inference", "status": "ok", "output_check": "MISMATCH: 1"},
    ]
    df = pd.DataFrame([{**base, **r} for r in rows])
    monkeypatch.setattr(gpu_check, "_run_suite", lambda *args: df)
    report = gpu_check.Report()
    gpu_check.check_levers(types.SimpleNamespace(device_type="cuda"), gpu_check.LEVERS, Path("."), report, 240)
    failed = sorted(what.split()[0] for what in report.failed)
    assert failed == ["crash", "free", "ort2", "serve", "teach", "why"]
    assert report.passed == 3  # plain, co, ort (skipped, saying why)


def test_the_step_figures_come_from_the_resnet50_bf16_step(gpu_check):
    import pandas as pd

    row = {"measurement": "distill_step", "teacher": "resnet50", "student": "resnet18", "precision": "bf16"}
    row |= {"status": "ok", "error": None, "median_ms": 100.0, "n": 20, "window_ms": 2040.0, "host_ms": 10.0}
    row |= {"phase_remainder_ms": -1.0}
    report = gpu_check.Report()
    gpu_check.step_figures(pd.DataFrame([row]), report)
    assert report.figures["step_window_ratio"] == pytest.approx(1.02)
    assert report.figures["step_host_ratio"] == pytest.approx(0.1)
    assert report.figures["step_remainder_ratio"] == pytest.approx(-0.01)
