"""benchmarks/gpu_check.py (the package benchmarks/gpu/) is run by hand on a GPU; what of it means something on
the CPU runs here, so the check cannot rot unnoticed between GPU sessions."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from kdbench.hw.backends import resolve
from tests.support.paths import ROOT

BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_check.py"
MODULES = ("main", "plan", "report", "runs", "steps") + tuple(
    f"checks.{name}"
    for name in ("clocks", "math_mode", "syncs", "telemetry", "memory", "phases", "suites", "lm", "fit")
)


@pytest.fixture(scope="module")
def gpu():
    """The check's modules by their short names (gpu.main, gpu.math_mode, ...), imported as gpu_check.py imports
    its package: benchmarks/ on sys.path (it is not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        modules = {name.rsplit(".", 1)[-1]: importlib.import_module(f"gpu.{name}") for name in MODULES}
    finally:
        sys.path.remove(str(BENCHMARKS))
    return types.SimpleNamespace(**modules)


@pytest.fixture(scope="module")
def quick_cpu_run(gpu, tmp_path_factory):
    """One `--device cpu --quick` run for the tests that read what it wrote."""
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    start = time.perf_counter()
    code = gpu.main.main(["--device", "cpu", "--quick", "--out", str(out)])
    return code, out, time.perf_counter() - start


def test_pytest_does_not_collect_the_gpu_check(pytestconfig):
    patterns = pytestconfig.getini("python_files")
    files = [SCRIPT, *(BENCHMARKS / "gpu").rglob("*.py")]
    assert not any(Path(f.name).match(p) for f in files for p in patterns)


def test_the_documented_command_runs_the_package():
    """``python benchmarks/gpu_check.py`` (docs/gpu-check.md, run_check.py's default script) reaches the package."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: gpu_check.py")
    assert "GPU check: what kdbench's GPU paths measure" in done.stdout and "--cell-timeout SECONDS" in done.stdout


def test_the_vision_step_is_built_as_a_cell_builds_it(gpu):
    """Review 5 §2.7: the syncs and phases stages' vision step is the cell's: its models from the seeded model
    cache, the classifier padded to pad_to, the batch from the cell's seed (not build_model under one seed)."""
    from kdbench.data.synthetic import synthetic_batch
    from kdbench.models import ModelCache
    from kdbench.workloads.vision import VISION

    cpu = resolve("cpu")
    config = gpu.steps.vision_config(
        pair={"teacher": "resnet20", "student": "resnet8"}, batch_size=4, pad_to=64, seed=3, method="kd"
    )
    step = gpu.steps.cell_step(cpu, config)
    try:
        teacher, student = VISION.build_pair(config, cpu, ModelCache())
        for built, cells in ((step.distiller.teacher, teacher), (step.distiller.student, student)):
            got, want = built.state_dict(), cells.state_dict()
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert student(step.x).shape == (4, 128)  # 100 classes padded to a multiple of 64
        x, y = synthetic_batch(config, 4, cpu.device, 3)
        assert torch.equal(step.x, x) and torch.equal(step.y, y)
        step()
        assert step.last_loss is not None and torch.isfinite(torch.as_tensor(step.last_loss))
    finally:
        step.close()


def test_math_check_passes_on_the_cpu_and_skips_tf32_with_its_reason(gpu, capsys):
    report = gpu.report.Report()
    gpu.math_mode.check_math(resolve("cpu"), report)
    out = capsys.readouterr().out
    assert report.failed == []
    # fp32, tf32 (skipped, as it should be), bf16, fp16, the flag getters in IEEE and in TF32, the fp32 error
    assert report.passed == 7
    assert "tf32: skipped here: tf32 is a GPU math mode" in out
    assert "fp32 matmul error" in out


def test_the_flag_getters_answer_inside_math_mode_and_agree_with_it(gpu):
    # gpu-review-2 G2: on torch >= 2.9 a legacy getter may raise inside math_mode; torch's compiler reads them
    for tf32 in (False, True):
        found = gpu.math_mode.flag_getters(tf32)
        names = [name for name, *_ in found]
        assert {"cudnn.allow_tf32", "cuda.matmul.allow_tf32", "get_float32_matmul_precision()"} <= set(names)
        wrong = [(name, value) for name, value, ok in found if not ok]
        assert wrong == [], f"math_mode({tf32}): {wrong}"


def test_a_raising_getter_is_a_failed_check_with_its_text(gpu, monkeypatch, capsys):
    def broken():
        raise RuntimeError("PyTorch is checking whether allow_tf32 is enabled")

    monkeypatch.setattr(gpu.math_mode, "FLAG_GETTERS", (("cudnn.allow_tf32", broken, False),))
    report = gpu.report.Report()
    gpu.math_mode.check_flag_getters(report)
    assert len(report.failed) == 2
    assert "raised RuntimeError: PyTorch is checking whether allow_tf32 is enabled (WRONG)" in capsys.readouterr().out


def test_a_failed_check_is_kept_and_printed(gpu, capsys):
    report = gpu.report.Report()
    assert report.check("one thing", True) is True
    assert report.check("another", False) is False
    assert report.passed == 1 and report.failed == ["another"]
    assert "FAIL another" in capsys.readouterr().out


def test_checks_that_need_a_gpu_say_so_on_the_cpu(gpu, capsys):
    report = gpu.report.Report()
    gpu.telemetry.check_telemetry(resolve("cpu"), report)
    gpu.memory.check_memory(resolve("cpu"), report)
    assert report.passed == 0 and report.failed == []
    assert capsys.readouterr().out.count("no GPU") == 2


def test_the_new_gpu_checks_say_so_on_the_cpu(gpu, tmp_path, capsys):
    report = gpu.report.Report()
    cpu = resolve("cpu")
    gpu.clocks.check_idle(cpu, report)
    gpu.syncs.check_syncs(cpu, report)
    gpu.suites.check_levers(cpu, gpu.plan.LEVERS, tmp_path, report, 240)
    gpu.lm.check_lm(cpu, gpu.plan.LM_SUITE, tmp_path, report, 240)
    assert report.passed == 0 and report.failed == []
    out = capsys.readouterr().out
    assert out.count("no GPU") == 4
    assert "no GPU: the levers suite needs one" in out and "no GPU: the LM suite needs one" in out


def test_the_plan_fits_one_device_command_and_quick_fits_with_margin(gpu):
    full = gpu.main.parse_args([])
    quick = gpu.main.parse_args(["--quick"])
    names = [name for name, *_ in gpu.plan.plan(full)]
    assert names[0] == "start-up" and {"levers", "syncs", "idle", "math", "suite", "lm", "fit", "report"} <= set(names)
    low, high = gpu.plan.plan_bounds(full)
    # the device command runs --quick: 8 minutes of a 10-minute command with the runner's probe and install before
    # it (on a simulated H100 or H200: the estimates are one for both); the full check is run by hand, 12 minutes
    stages = gpu.plan.plan(quick)
    assert "report" not in [name for name, *_ in stages]  # --quick leaves the report to `kdbench report`
    quick_low, quick_high = gpu.plan.plan_bounds(quick)
    assert (quick_low, quick_high) == (
        sum(s[1] for s in stages) + gpu.plan.RUNNER[0],
        sum(s[2] for s in stages) + gpu.plan.RUNNER[1],
    )
    assert 0 < quick_low <= quick_high <= 480 == gpu.plan.DEVICE_COMMAND_S
    assert 0 < low <= high <= 720 == gpu.plan.FULL_COMMAND_S
    assert quick_high < high
    assert gpu.plan.plan_bounds(gpu.main.parse_args(["--skip", "levers"]))[1] == high - 240
    lm = {name: (low, high) for name, low, high, _ in gpu.plan.plan(full)}["lm"]
    assert gpu.plan.plan_bounds(gpu.main.parse_args(["--skip", "lm"]))[1] == high - lm[1] and lm[0] > 0
    assert gpu.main.parse_args([]).cell_timeout == 240


def test_quick_suites_are_subsets_with_the_cells_the_summary_reads(gpu, tmp_path):
    from kdbench.config.load import load_suite
    from kdbench.workloads import expand_checked

    smoke = gpu.runs.subset_suite(gpu.plan.SMOKE, gpu.runs.quick_smoke_case, tmp_path, "gpu-smoke-quick")
    levers = gpu.runs.subset_suite(gpu.plan.LEVERS, gpu.runs.quick_lever_case, tmp_path, "gpu-levers-quick")
    full_smoke = {c.cell_id for c in expand_checked(load_suite(gpu.plan.SMOKE))}
    full_levers = {c.cell_id: c.config for c in expand_checked(load_suite(gpu.plan.LEVERS))}
    quick_smoke = [c.config for c in expand_checked(load_suite(smoke)) if c.cell_id in full_smoke]
    quick_levers = [c.config for c in expand_checked(load_suite(levers)) if c.cell_id in full_levers]
    assert len(quick_smoke) == 3 and len(quick_levers) == 6  # the same cells (same ids) as in the full suites
    assert not any(c.tunableop for c in quick_levers) and any(c.tunableop for c in full_levers.values())
    assert any(c.pair.student == "resnet18" and c.precision == "bf16" for c in quick_smoke)
    assert [c.compile for c in quick_levers if c.compile != "off"] == ["reduce-overhead"]
    assert any(c.compile_teacher for c in quick_levers)


def test_the_lm_suite_covers_every_lm_path_and_quick_runs_it_whole(gpu):
    from kdbench.config.load import load_suite
    from kdbench.distill.lm.impls import LOSS_IMPLS
    from kdbench.workloads import expand_checked, planned_measurements

    full = expand_checked(load_suite(gpu.plan.LM_SUITE))
    configs = [c.config for c in full]
    assert {c.loss_impl for c in configs} == set(LOSS_IMPLS)  # every loss_impl
    assert any(c.teacher.weights == "bf16" for c in configs) and any(c.teacher.mode == "topk_cache" for c in configs)
    assert any(c.on_policy is not None for c in configs)
    measured = {str(m) for c in configs for m, _ in planned_measurements(c)}
    assert {"student_prefill", "student_decode", "teacher_prefill", "teacher_decode", "speculative_decode"} <= measured
    # every generation backend a user can select (GPU review 4, M6), speculative decoding greedy and sampled, and a
    # cross-tokenizer cell
    backends = {(c.generation.cache, c.generation.compile) for c in configs if c.inference.batch_sizes}
    assert backends == {("dynamic", False), ("static", False), ("static", True)}
    spec = [c.inference.speculative for c in configs if c.inference.speculative is not None]
    assert len(spec) == 1 and spec[0].temperature == [0.0, 1.0]
    assert any(c.data.tokenizers is not None and c.method == "uld" for c in configs)
    assert len(full) == 12 and sum(len(planned_measurements(c)) for c in configs) == 30
    # --quick (the device command's) runs it whole, every loss_impl: the stage planned at its full time
    stage = {s.name: s for s in gpu.plan.PLAN}["lm"]
    assert (stage.quick_low, stage.quick_high) == (stage.low, stage.high)


def test_the_lm_stage_on_a_simulated_gpu_judges_every_row_of_the_lm_suite(gpu, monkeypatch, tmp_path, capsys):
    """The LM stage as a GPU runs it (a simulated one, the suite's rows as read_results gives them): an ok row
    passes with its attention kernel and, on a step, 0 < mfu <= 1; a row without its kernel, a top-k cell without
    its cache bytes, an on-policy step without its generation phase, or a failed row fails; a skip with its reason
    passes (gpu-review-3 L10)."""
    import pandas as pd

    from kdbench.core.schema import COLUMNS
    from tests.support.helpers import simulated_gpu

    step = {"measurement": "distill_step", "status": "ok", "median_ms": 4.0, "tokens_per_s": 2.5e5, "mfu": 0.2}
    step |= {"loss_rel_err": 1e-3, "grad_rel_err": 2e-3, "predicted_step_ms": 5.0, "predicted_step_ratio": 0.8}
    head = "4 ms, 2.5e+05 tokens/s, attention"
    told = "mfu 0.2, predicted 5 ms (measured/predicted 0.80):"
    decode = {**step, "measurement": "student_decode", "mfu": None, "attention_kernel": "flash"}
    decode |= {"served_weights": "bf16", "decode_bytes_per_token": 3.2e7, "loss_rel_err": None, "grad_rel_err": None}
    rows = [
        {**step, "cell_label": "dense", "attention_kernel": "cudnn"},
        {**decode, "cell_label": "dense"},
        {**step, "cell_label": "fused_linear", "attention_kernel": None},  # the kernel not recorded
        {**step, "cell_label": "topk", "attention_kernel": "cudnn", "teacher_mode": "topk_cache"},  # no cache bytes
        {**step, "cell_label": "topk ok", "attention_kernel": "cudnn", "teacher_mode": "topk_cache"}
        | {"teacher_cache_bytes_per_token": 1024.0},
        {**step, "cell_label": "gkd", "attention_kernel": "cudnn", "on_policy_new_tokens": 32},  # no generate phase
        {**step, "cell_label": "gkd ok", "attention_kernel": "cudnn", "on_policy_new_tokens": 32}
        | {"phase_generate_ms": 1.5},
        {**step, "cell_label": "mfu", "attention_kernel": "cudnn", "mfu": 1.5},  # more than the datasheet's peak
        {"measurement": "distill_step", "status": "skipped", "cell_label": "liger", "error": "liger-kernel missing"},
        {"measurement": "distill_step", "status": "failed", "cell_label": "torch_linear", "error": "boom"},
        # the paths GPU review 4 added (M3, M6): the ledger, a backend's tokens, speculative acceptance, xtok
        {**step, "cell_label": "ledger", "attention_kernel": "cudnn", "grad_rel_err": 0.05},
        {**step, "cell_label": "noledger", "attention_kernel": "cudnn", "loss_rel_err": None},
        {**decode, "cell_label": "static tie", "output_check": "ok to a near-tie: the same greedy tokens up to 3"},
        {**decode, "cell_label": "static bad", "output_check": "MISMATCH: 3 of the 17 greedy tokens differ"},
        {**decode, "cell_label": "unserved", "served_weights": None},
        {**decode, "cell_label": "spec", "measurement": "speculative_decode", "spec_alpha": 0.7}
        | {"served_weights": None},
        {**decode, "cell_label": "spec bad", "measurement": "speculative_decode", "spec_alpha": 1.5},
        {**step, "cell_label": "xtok", "attention_kernel": "cudnn", "student_tokenizer": "bpe:1024"},
        {**step, "cell_label": "xtok ok", "attention_kernel": "cudnn", "student_tokenizer": "bpe:1024"}
        | {"phase_align_ms": 0.4},
    ]
    df = pd.DataFrame(rows).reindex(columns=[c.name for c in COLUMNS]).assign(batch_size=2)
    asked = []
    monkeypatch.setattr(gpu.lm, "run_suite", lambda backend, suite, *a: asked.append((backend.name, suite)) or df)
    report = gpu.report.Report()
    gpu.lm.check_lm(simulated_gpu("cuda"), gpu.plan.LM_SUITE, tmp_path, report, 240)
    out = capsys.readouterr().out
    assert asked == [("cuda", gpu.plan.LM_SUITE)]
    assert "kdbench run gpu-lm.yaml: the LM paths" in out
    # dense step and decode, the two complete cells, the skip with its reason, the near-tie, spec, xtok ok
    assert report.passed == 8
    failed = "\n".join(report.failed)
    assert len(report.failed) == 11
    for problem in (
        f"fused_linear distill_step bs2: {head} not recorded, {told} no attention_kernel",
        f"topk distill_step bs2: {head} cudnn, {told} no teacher_cache_bytes_per_token",
        f"gkd distill_step bs2: {head} cudnn, {told} no phase_generate_ms",
        "mfu / ceiling_utilization 1.5 not in (0, 1]",
        "torch_linear distill_step bs2: failed: boom",
        f"ledger distill_step bs2: {head} cudnn, {told} grad_rel_err 0.05 outside [0, 0.0",
        f"noledger distill_step bs2: {head} cudnn, {told} no loss_rel_err (the accuracy",
        "static bad student_decode bs2: 4 ms, 2.5e+05 tokens/s, attention flash (served bf16, 3.2e+07 B/token, "
        "MISMATCH: 3 of the 17 greedy tokens differ): output_check MISMATCH",
        "unserved student_decode bs2: 4 ms, 2.5e+05 tokens/s, attention flash (3.2e+07 B/token): no served_weights",
        "spec bad speculative_decode bs2: 4 ms, 2.5e+05 tokens/s, attention flash (served bf16, 3.2e+07 B/token, "
        "alpha 1.5): spec_alpha 1.5 not in [0, 1]",
        f"xtok distill_step bs2: {head} cudnn, {told} a cross-tokenizer step without",
    ):
        assert problem in failed, failed
    passed = out.split("\nok   ")
    assert any(p.startswith("static tie student_decode bs2") for p in passed)
    assert any(p.startswith("spec speculative_decode bs2") and "alpha 0.7" in p for p in passed)
    assert "attention kernels that ran: cudnn, flash" in out


@pytest.mark.slow
def test_the_lm_steps_of_the_syncs_stage_build_and_sync_where_it_says(gpu):
    """The syncs stage's LM steps, built on the CPU; kdbench's counter sees there the value reads a GPU syncs on
    (not the host-to-device copies): kdbench's step none, liger's one read-back (its copy is the GPU's second),
    and transformers' causal-mask builder once per forward, teacher's and student's."""
    from kdbench.measure.syncs import optimizer_host_tensors, sync_calls

    cpu = resolve("cpu")
    small = {"teacher": {"vocab_size": 256}, "student": {"vocab_size": 256}}
    data = {"kind": "tokens", "seq_len": 16, "prompt_fraction": 0.25}
    for impl, reads in (("fused_linear", 0), ("liger", gpu.syncs.LIGER_SYNCS - 1)):
        config = gpu.steps.lm_config(loss_impl=impl, precision="fp32", teacher_precision="fp32", overrides=small)
        config = config.model_copy(update={"data": config.data.model_copy(update=data), "chunk_size": 8})
        step = gpu.steps.cell_step(cpu, config)
        try:
            step()
            step()
            exempt = optimizer_host_tensors(step.distiller.optimizer)
            own, with_model, why = gpu.syncs.lm_sync_expectations(impl, packed_check=True)
            with gpu.syncs.without_packed_check():
                assert len(sync_calls(step, cpu, exempt=exempt)) == reads
            assert len(sync_calls(step, cpu, exempt=exempt)) - reads == with_model - own == 2
            assert ("liger-kernel" in why) == (impl == "liger")
        finally:
            step.close()


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
        "no GPU: the LM suite needs one",
        "no GPU: nothing synchronises on the CPU",
        "no GPU: the host clock times the sleep",
        "no GPU: the CPU has no allocator counters",
        "no GPU: --quick on the CPU skips the suite stage",
    ):
        assert line in log
    assert "plan (--quick): seconds on a warm H100 or H200" in log
    assert "(within 480 s, the device command's budget, the runner included)" in log  # the quick plan, its bound
    assert "   lm           90-160  gpu-lm.yaml: 12 tiny-Llama cells" in log  # the LM stage, planned
    assert "--quick skips the report stage: `kdbench report` renders results.tar.gz" in log
    # the fit stage predicts its GiB-scale cell on the CPU too; measuring it needs a GPU
    assert "ok   qwen2.5-1.5b->qwen2.5-0.5b bf16 2x2048 fused_linear: predicted " in log
    assert "no GPU: the measured peak, the reserve and the context need one" in log
    assert "software: torch " in log and "transformers " in log  # which torch it ran
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
    assert "\nsoftware:  torch " in summary and ", transformers " in summary and ", liger-kernel " in summary
    assert "lm no GPU" in summary  # the LM stage, listed with what became of it
    for number in range(1, 6):
        assert f"\n  {number}. " in summary
    assert "probe bf16 matmul, TFLOP/s:" in summary and "INFO: no expected range for cpu" in summary
    assert "5. energy counter over sampled power, GEMM window: n/a: " in summary


def test_first_run_numbers_are_judged_against_the_h200_ranges(gpu):
    report = gpu.report.Report()
    report.figure("probe_bf16_tflops", 781.0)
    report.figure("energy_ratio", 1.4)
    report.figure("clock_adds_launch_bound", True)
    fig = {f.key: f for f in gpu.report.FIGURES}
    assert gpu.report.judge(fig["probe_bf16_tflops"], report, "NVIDIA H200", {}).endswith("PASS")
    assert gpu.report.judge(fig["energy_ratio"], report, "NVIDIA H200", {}).endswith("FAIL")
    assert gpu.report.judge(fig["clock_adds_launch_bound"], report, "NVIDIA H200", {}).endswith("PASS")
    assert "INFO: no expected range for NVIDIA A100" in gpu.report.judge(
        fig["probe_bf16_tflops"], report, "NVIDIA A100", {}
    )
    assert "n/a: the telemetry stage skipped" in gpu.report.judge(
        fig["energy_ratio"], gpu.report.Report(), "x", {"telemetry": "skipped"}
    )


def test_a_stopped_run_still_leaves_its_summary_and_log(gpu, monkeypatch, tmp_path):
    def stopped(*args, **kwargs):
        raise gpu.main.Stopped("stopped by SIGTERM")

    monkeypatch.setattr(gpu.main, "check_idle", stopped)
    out = tmp_path / "out"
    code = gpu.main.main(["--device", "cpu", "--quick", "--out", str(out), "--skip", "probe"])
    assert code == 1
    summary = (out / "summary.txt").read_text()
    assert "stopped by SIGTERM" in summary and "idle stopped by SIGTERM" in summary
    assert "math done" in summary and "syncs not reached" in summary
    assert "FAIL idle: stopped by SIGTERM" in (out / "check.log").read_text()


def test_lever_rows_pass_ok_or_skipped_with_a_reason_and_compiled_rows_need_a_one_off_cost(gpu, monkeypatch):
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
    monkeypatch.setattr(gpu.suites, "run_suite", lambda *args: df)
    report = gpu.report.Report()
    gpu.suites.check_levers(types.SimpleNamespace(device_type="cuda"), gpu.plan.LEVERS, Path("."), report, 240)
    failed = sorted(what.split()[0] for what in report.failed)
    assert failed == ["crash", "free", "ort2", "serve", "teach", "why"]
    assert report.passed == 3  # plain, co, ort (skipped, saying why)


def test_the_step_figures_come_from_the_resnet50_bf16_step(gpu):
    import pandas as pd

    row = {"measurement": "distill_step", "teacher": "resnet50", "student": "resnet18", "precision": "bf16"}
    row |= {"status": "ok", "error": None, "median_ms": 100.0, "n": 20, "window_ms": 2040.0, "host_ms": 10.0}
    row |= {"phase_remainder_ms": -1.0}
    report = gpu.report.Report()
    gpu.suites.step_figures(pd.DataFrame([row]), report)
    assert report.figures["step_window_ratio"] == pytest.approx(1.02)
    assert report.figures["step_host_ratio"] == pytest.approx(0.1)
    assert report.figures["step_remainder_ratio"] == pytest.approx(-0.01)


def test_the_lm_stage_reports_the_fit_planners_prediction_against_the_gpus_peak(gpu, capsys):
    import pandas as pd

    df = pd.DataFrame(
        {
            "measurement": ["distill_step", "distill_step", "student_prefill"],
            "status": ["ok", "ok", "ok"],
            "cell_label": ["dense", "liger", "dense"],
            "predicted_peak_bytes": [2 * 2**30, None, None],
            "predicted_peak_phase": ["loss", None, None],
            "live_peak_bytes": [int(2.1 * 2**30), 3 * 2**30, None],
            "predicted_peak_ratio": [1.05, None, None],
        }
    )
    report = gpu.report.Report()
    gpu.lm.report_fit(df, report)
    out = capsys.readouterr().out
    assert "fit dense: predicted 2.000 GiB in loss, measured 2.100 GiB (max_memory_allocated)" in out
    assert "measured/predicted 1.050" in out and "fit liger: unpredictable" in out
    assert "fit planner on this GPU: measured/predicted 1.050-1.050 over 1 steps" in out
    assert report.failed == [] and report.passed == 0  # information, not checks


def test_the_runs_the_check_starts_count_the_check_as_their_own(gpu, monkeypatch, tmp_path):
    """GPU review 4, M8: the check holds a GPU context while its kdbench runs measure; rooted at the check, the
    runs do not count it as another process on the device (nor, in a container, its one context)."""
    import os

    from kdbench.hw.contention import OWN_CONTEXTS_ENV, RUN_PID_ENV, others_on_device

    seen = {}

    class Done:
        """Popen's stand-in: records the environment, prints one line, exits 0."""

        stdout = type("Lines", (), {"__iter__": lambda self: iter(["ran\n"]), "close": lambda self: None})()

        def __init__(self, command, env, **_):
            seen.update(env)

        def wait(self, *_):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(gpu.runs.subprocess, "Popen", Done)
    report = gpu.report.Report()
    assert gpu.runs.run_kdbench(report, "run", "suite.yaml")
    assert seen[RUN_PID_ENV] == str(os.getpid()) and seen[OWN_CONTEXTS_ENV] == "1"
    # the device lists the check and the run's worker: no other process, named or (a container) unnamed
    assert others_on_device([os.getpid(), 4242], [os.getpid(), 4242]) == 0
    monkeypatch.setenv(OWN_CONTEXTS_ENV, "1")
    assert others_on_device([7, 8], [os.getpid()]) == 0 and others_on_device([7, 8, 9], [os.getpid()]) == 1


def test_an_h100_sxm_is_judged_against_the_h200s_compute_ranges(gpu):
    """GPU review 4, M11: the H100 SXM has the H200's dense datasheet figures; its PCIe card does not."""
    key, ranges = gpu.report.expected_for("NVIDIA H100 80GB HBM3")
    assert key == "H100 80GB HBM3" and ranges == gpu.report.EXPECTED["H200"]
    assert gpu.report.expected_for("NVIDIA H100 PCIe") is None


def test_the_fit_stage_prints_predicted_allocated_reserved_and_context(gpu, monkeypatch):
    """GPU review 4, M4: the GiB-scale cell's prediction against max_memory_allocated, the allocator's reserve at the
    peak, and the device's context (total - free - reserved), beside kdbench's headroom for the card."""
    gib = 2**30
    row = {"predicted_peak_bytes": 20 * gib, "live_peak_bytes": 21 * gib}
    row |= {"peak_memory_bytes": 22 * gib, "peak_reserved_bytes": 24 * gib}
    sizes = {"mem_get_info": (50 * gib, 80 * gib), "memory_reserved": 29 * gib, "memory_allocated": 3 * gib}
    for name, value in sizes.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    device = gpu.fit.device_memory(types.SimpleNamespace(device="cuda:0"))
    assert device == {"total": 80 * gib, "free": 50 * gib, "reserved": 29 * gib, "allocated": 3 * gib, "context": gib}
    lines = gpu.fit.memory_lines(row, device)
    assert "predicted 20.000 GiB, measured 21.000 GiB" in lines[0] and "measured/predicted 1.050" in lines[0]
    assert "peak reserved 24.000 GiB, reserved/allocated 1.091" in lines[1]
    assert "total 80.00 GiB, free 50.00 GiB" in lines[2] and "context 1.000 GiB (total - free - reserved)" in lines[2]
    line = gpu.fit.headroom_line("NVIDIA H100 80GB HBM3")  # the table's model, even on the GPU it names
    assert line.startswith("kdbench's headroom model for H100") and "total 79.11 GiB" in line, line
    assert "context kept 0.750 GiB, BLAS workspaces " in line and "fragmentation 5% of the peak" in line
    assert "device table has no NVIDIA X9" in gpu.fit.headroom_line("NVIDIA X9")
    config = gpu.fit.gib_config()
    pair = (config.pair.teacher, config.pair.student, config.loss_impl)
    assert pair == ("qwen2.5-1.5b", "qwen2.5-0.5b", "fused_linear")
    assert config.batch_size * config.data.seq_len == 2 * 2048


def test_the_decode_of_the_syncs_stage_reads_no_value_back(gpu, capsys):
    """GPU review 4, M6: the syncs stage's dynamic-cache decode (the student held in bf16 as a bf16 cell serves it);
    on the CPU kdbench's counter sees the value reads a GPU would sync on: none in 16 tokens."""
    report = gpu.report.Report()
    gpu.syncs.check_decode_syncs(resolve("cpu"), report)
    assert report.passed == 1 and report.failed == []
    assert "greedy decode, 16 tokens on the dynamic cache, transformers 5" in capsys.readouterr().out
