"""The command line end to end: a tiny suite in, parquet rows and a report out; errors as one line."""

import math
import re
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest

from kdbench.cli import main
from kdbench.core.schema import STORED_SCHEMA
from kdbench.store import read_results
from tests.support.helpers import run_folder, write_suite
from tests.support.paths import ROOT, SUPPORT
from tests.support.suites import merged, tiny_suite

TINY = tiny_suite(
    defaults={
        "batch_size": 8,
        "data": {"kind": "synthetic", "shape": [1, 8, 8], "num_classes": 10},
        "timing": {"warmup": 1},
        "inference": {"batch_sizes": [1, 4]},
    },
    matrix={"pair": [{"teacher": "resnet8", "student": "linear"}], "precision": ["fp32", "bf16"], "seed": [0, 1]},
    exclude=[{"precision": "bf16", "seed": 1}],
)


def _pair(teacher: str, student: str) -> dict:
    """The overrides that give TINY's one matrix pair these models."""
    return {"matrix": {"pair": [{"teacher": teacher, "student": student}]}}


@pytest.fixture
def tiny(tmp_path):
    return write_suite(tmp_path / "tiny.yaml", **TINY)


@pytest.mark.slow
def test_run_stores_every_measurement_and_renders_the_report(tiny, tmp_path, capsys):
    out, rep = tmp_path / "res", tmp_path / "rep"
    assert main(["run", str(tiny), "--out", str(out), "--report-dir", str(rep)]) == 0
    run = run_folder(out)
    assert run.run_id.startswith("tiny-") and len(run.parts()) == 3  # a part per cell
    table = pq.read_table(run.parts()[0])
    assert table.column_names == STORED_SCHEMA.names
    rows = read_results([run.path]).to_dict("records")
    assert len(rows) == 3 * 5  # 3 cells x (step + 2 x student/teacher inference)
    by = {(r["precision"], r["seed"], r["measurement"], r["batch_size"]): r for r in rows}
    step = by[("fp32", 0, "distill_step", 8)]
    assert step["status"] == "ok" and pd.isna(step["error"])
    assert step["n"] == len(step["samples_ms"]) >= 3
    assert step["median_ms"] > 0 and step["first_ms"] > 0
    assert step["throughput"] == pytest.approx(8 / (step["median_ms"] / 1e3))
    assert step["timer"] == "perf_counter_ns" and step["cpu_threads"] == 1
    assert step["teacher"] == "resnet8" and step["student"] == "linear" and step["backend"] == "cpu"
    assert step["student_params"] == 64 * 10 + 10
    assert step["autocast"] is False
    bf16 = by[("bf16", 0, "distill_step", 8)]
    assert bf16["autocast"] is True and bf16["grad_scaler"] is False
    s1, t1 = by[("fp32", 0, "student_inference", 1)], by[("fp32", 0, "teacher_inference", 1)]
    assert s1["speedup_vs_teacher"] == pytest.approx(t1["median_ms"] / s1["median_ms"])
    assert math.isnan(t1["speedup_vs_teacher"])
    assert all(r["status"] == "ok" for r in rows)
    assert step["data_ptr_mod64"] == 0 and step["memory_format_verified"] and step["padded_classes"] == 10
    assert len({r["cell_id"] for r in rows}) == 3 and len({r["run_id"] for r in rows}) == 1
    html = (rep / "index.html").read_text()
    assert "linear" in html and (rep / "distill_step.png").exists()
    printed = capsys.readouterr().out
    assert "[3/3]" in printed and "left" in printed and "report ->" in printed


def test_dry_run_lists_cells_and_runs_nothing(tiny, tmp_path, capsys):
    assert main(["run", str(tiny), "--dry-run", "--out", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 4 and out[-1].startswith("3 cells, 15 measurements")
    assert "resnet8->linear kd fp32 bs8" in out[1] and "resnet8->linear kd bf16 bs8" in out[2]
    assert not (tmp_path / "res").exists()


def test_failing_cell_is_recorded_and_exit_code_is_1(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SUPPORT))  # faulty_models, for the worker process too
    faulty = merged(TINY, {"allow_imports": True, **_pair("faulty_models:raising", "linear")})
    suite = write_suite(tmp_path / "bad.yaml", **faulty)
    assert main(["run", str(suite), "--out", str(tmp_path), "--no-report"]) == 1
    rows = read_results([run_folder(tmp_path).path]).to_dict("records")
    failed = [r for r in rows if r["status"] == "failed"]
    assert {r["measurement"] for r in failed} == {"distill_step", "teacher_inference"}
    assert all("injected failure" in r["error"] for r in failed)
    # the student's own inference does not need the teacher and still ran
    assert any(r["status"] == "ok" and r["measurement"] == "student_inference" for r in rows)
    err = capsys.readouterr().err
    assert "3 job(s) had failures" in err and "faulty_models:raising->linear kd fp32 bs8 seed1" in err


def _cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "kdbench", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.mark.slow
def test_user_errors_exit_2_with_one_line_and_no_traceback(tmp_path):
    bad = write_suite(tmp_path / "bad.yaml", **merged(TINY, _pair("resnet8", "linaer")))
    for args in (
        ["run", str(bad)],
        ["run", str(tmp_path / "missing.yaml")],
        ["report", str(tmp_path)],
        ["run", str(ROOT / "suites" / "amd.yaml")],
    ):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kdbench: error: "), r.stderr
    assert "did you mean linear" in _cli("run", str(bad)).stderr
    amd = _cli("run", str(ROOT / "suites" / "amd.yaml")).stderr
    assert "rocm" in amd and "--device cpu" in amd and "amd.yaml" in amd
    assert not list(tmp_path.glob("*.parquet"))


def test_every_shipped_suite_dry_runs(capsys):
    # in this process (the command itself, as a subprocess, is test_shipped_suite_dry_run_as_a_command's)
    for suite in sorted((ROOT / "suites").glob("*.yaml")):
        assert main(["run", str(suite), "--dry-run"]) == 0, capsys.readouterr().err
        assert " cells, " in capsys.readouterr().out.splitlines()[-1], suite


def test_shipped_suite_dry_run_as_a_command():
    r = _cli("run", str(ROOT / "suites" / "llm-fsdp.yaml"), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert " cells, " in r.stdout.splitlines()[-1]


def test_the_fsdp_suite_dry_run_prints_each_cells_host_figure_per_rank(capsys):
    assert main(["run", str(ROOT / "suites" / "llm-fsdp.yaml"), "--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "llama-3.1-8b->llama-3.2-1b" in line]
    assert len(lines) == 10  # every cell of the suite: the 8B teacher into the 1B student
    size = r"([\d.]+) ([KMG])iB"
    figure = re.compile(rf"host {size} (per rank|on rank 0, {size} on each other rank); step at least ")

    def nbytes(value: str, unit: str) -> float:
        return float(value) * 2 ** {"K": 10, "M": 20, "G": 30}[unit]

    for line in lines:
        found = figure.search(line)
        assert found, line
        if "-fsdp" in line:  # rank 0 builds the frozen teacher on its host; the other ranks on meta
            assert "on rank 0" in found[3] and nbytes(found[1], found[2]) < 64e9 > 10 * nbytes(found[4], found[5])
        else:  # both models built on each rank's device: one tensor's fp32 draw at a time on the host
            assert found[3] == "per rank" and nbytes(found[1], found[2]) < 4 * 2**30
    rank0 = {
        "teacher-weights-bf16" in line: nbytes(*figure.search(line).group(1, 2)) for line in lines if "-fsdp" in line
    }
    assert rank0[True] < 0.6 * rank0[False]  # a bf16-held teacher: about half the host of an fp32 one on rank 0


def test_list_and_env(capsys):
    assert main(["list", "models"]) == 0
    out = capsys.readouterr().out
    assert "resnet32x4" in out and "mobilenet_v3_large" in out and "linear" in out
    assert "parameters at 100 classes, 3x32x32" in out
    assert re.search(r"^  resnet20 +0\.28 M$", out, flags=re.M)  # RepDistiller's resnet20 at 100 classes
    # LMs and encoders with what one needs to pick a seq_len (issue 32)
    assert re.search(r"^  llama-3\.1-8b +8030\.26 M  vocabulary 128,256, positions 131,072$", out, flags=re.M)
    assert re.search(r"^  gpt2 +124\.44 M  vocabulary 50,257, positions 1,024$", out, flags=re.M)  # n_positions
    assert re.search(r"^  bert-base +109\.48 M  vocabulary 30,522, positions 512$", out, flags=re.M)
    assert main(["list", "methods"]) == 0
    assert "temperature=4.0, alpha=0.9" in capsys.readouterr().out
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("backend: cpu") and "torch_version:" in out and "cpu_threads:" in out
    # the TF32 lines are this process's torch defaults, which a run does not inherit (docs review)
    assert "this process's torch defaults: a run sets them per measurement" in out


def test_list_suites_gives_cells_description_and_the_recorded_time(capsys, monkeypatch, tmp_path):
    # three suites (loading all of suites/ is the docgen block's test): two shipped, one times.toml does not know
    import shutil

    from kdbench import api

    for name in ("cpu.yaml", "quality.yaml"):
        shutil.copy(ROOT / "suites" / name, tmp_path / name)
    (tmp_path / "times.toml").write_text(  # figures of the test's own: the shipped ones are re-measured
        'machine = "2-core VM"\n\n["cpu.yaml"]\nmachine = "2-core VM with AVX-512 BF16"\ncpu_s = 111\n'
        'how = "measured"\ndate = "2026-12-01"\nsource = "a sample run"\nnote = "bf16 cells measured"\n'
        'gpu = "under a minute"\n\n'
        '["quality.yaml"]\nhow = "not measured"\nsource = "nowhere"\nnote = "2 min 32 s with four methods"\n'
        'gpu = "a few minutes"\n'
    )
    write_suite(tmp_path / "mine.yaml", **merged(TINY, {"name": "mine", "description": "my own"}))
    monkeypatch.setattr(api, "SUITES_DIR", tmp_path)
    assert main(["list", "suites"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"3 suites in {tmp_path}; CPU: the wall time of `kdbench run SUITE --device cpu` on a ")
    assert lines[1:] == [
        "cpu.yaml (cpu-quick): 4 cells; Small CIFAR pairs, fp32 vs bf16, on the CPU.",
        "    CPU: 1 min 51 s; 2026-12-01; bf16 cells measured; on a 2-core VM with AVX-512 BF16",
        "    one GPU: under a minute (estimate)",
        "quality.yaml (quality): 8 cells, then the quality job; Digits, resnet20 -> resnet8, "
        "kd/fitnet/at/dkd/crd/reviewkd/rkd/dist vs scratch over 3 seeds.",
        "    CPU: not measured; 2 min 32 s with four methods",
        "    one GPU: a few minutes (estimate)",
        "mine.yaml (mine): 3 cells; my own",
        "    CPU: no entry in suites/times.toml",
    ]


def test_list_loss_impls_says_what_each_needs_and_computes(capsys):
    assert main(["list", "loss-impls"]) == 0
    blocks = capsys.readouterr().out.split("\n")[1:]
    by_impl = {line.split(":")[0]: blocks[i + 1 : i + 3] for i, line in enumerate(blocks) if line[:1].isalpha()}
    assert list(by_impl) == ["dense", "natural", "chunked", "fused_linear", "liger", "torch_linear"]
    every = "    divergences: forward_kl, reverse_kl, jsd, tvd, skew_fkl, skew_rkl"
    assert by_impl["dense"][0] == by_impl["fused_linear"][0] == every
    assert by_impl["liger"][0] == "    divergences: forward_kl, reverse_kl, jsd, skew_fkl at lam=0, skew_rkl at lam=0"
    assert by_impl["torch_linear"][0] == "    divergences: forward_kl, jsd at beta=0, skew_fkl at lam=0"
    assert by_impl["dense"][1] == "    needs: nothing beyond kdbench [lm] (available here)"
    assert by_impl["liger"][1].startswith("    needs: liger-kernel >= 0.6.5 (the `liger` extra) (")


def test_list_liger_without_liger_kernel_says_so(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    assert main(["list", "loss_impls"]) == 0
    out = capsys.readouterr().out
    from kdbench.core.install import extra_hint

    assert f"(not here: liger needs liger-kernel, which is not installed: {extra_hint('liger')})" in out


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("## Quick start", 1)[1].split("## ", 1)[0].split("```bash")[1:]
    commands = [b.split("```")[0].strip().splitlines()[-1] for b in blocks]
    assert len(commands) == 2
    assert "kdbench run suites/cpu.yaml" in commands[0]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_help_suggests_nothing_that_runs_for_hours_on_a_cpu(capsys):
    # docs review: the epilog suggested `run suites/cuda.yaml --device cpu` (78 ImageNet-shape cells, hours)
    from kdbench.cli.parser import EPILOG

    for line in EPILOG.splitlines():
        if "--device cpu" in line:
            assert not any(gpu in line for gpu in ("amd.yaml", "cuda.yaml", "gpu-smoke.yaml", "gpu-levers.yaml")), line
        if "run suites/methods.yaml" in line:
            assert "min" in line, line  # a long CPU run says how long
