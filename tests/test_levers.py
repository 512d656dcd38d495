"""Levers: their suite keys, the cells' identity, GPU-only levers on the CPU, the device settings (simulated
GPU), the one-off cost of a step's first calls, the optimizer implementation, and the break-even."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import pytest
import torch

from kdbench.cli import main
from kdbench.config.plan import Cell, cell_id_of, config_dict
from kdbench.distill.step import compile_mode, make_optimizer
from kdbench.hw.backends import Backend
from kdbench.measure.cell import measure_cell
from kdbench.measure.levers import LeverWatch, device_levers, skip_reason, tunableop_file
from kdbench.measure.timing import RawTiming
from kdbench.models import ModelCache
from tests.helpers import as_read, make_config, write_suite

CPU = Backend("cpu", torch.device("cpu"))
CUDA = Backend("cuda", torch.device("cuda", 0))


def test_yaml_on_off_and_the_lever_keys(tmp_path, capsys):
    suite = write_suite(
        tmp_path / "s.yaml",
        name="s",
        defaults={"pair": {"teacher": "linear", "student": "linear"}},
        matrix={"compile": [False, True, "max-autotune"], "optimizer.impl": ["default", "fused"]},
    )
    assert main(["run", str(suite), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "6 cells" in out and "compile-default fused" in out and "compile-max-autotune" in out
    assert make_config(compile=False).compile == "off" and make_config(compile=True).compile == "default"
    bad = write_suite(
        tmp_path / "b.yaml",
        name="b",
        defaults={"pair": {"teacher": "linear", "student": "linear"}},
        matrix={"compile": ["fast"]},
    )
    assert main(["run", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "matrix.compile" in err and "'off', 'default', 'reduce-overhead' or 'max-autotune'" in err


def test_a_lever_at_its_default_leaves_the_cell_id_alone():
    plain = make_config()
    explicit = make_config(
        compile="off",
        graphs=False,
        optimizer={"impl": "default"},
        inference={"batch_sizes": [1, 4], "runtime": "eager"},
    )
    assert cell_id_of(plain) == cell_id_of(explicit)
    assert not {"compile", "compile_teacher", "graphs", "conv_autotune", "tunableop"} & set(config_dict(plain))
    assert "impl" not in config_dict(plain)["optimizer"] and "runtime" not in config_dict(plain)["inference"]
    pulled = make_config(compile="default", inference={"batch_sizes": [1], "runtime": "int8"})
    assert config_dict(pulled)["compile"] == "default" and config_dict(pulled)["inference"]["runtime"] == "int8"
    assert cell_id_of(pulled) != cell_id_of(plain)


@pytest.mark.parametrize("lever", ["graphs", "conv_autotune", "tunableop"])
def test_gpu_only_levers_skip_the_cell_on_the_cpu_with_a_reason(lever):
    config = make_config(**{lever: True})
    reason = skip_reason(config, CPU)
    assert reason and "GPU" in reason and "--device cuda or rocm" in reason
    assert skip_reason(config, CUDA) is None and skip_reason(make_config(), CPU) is None
    rows = measure_cell(Cell(0, "c", config), CPU, ModelCache())  # skipped before any model is built
    assert {r["status"] for r in rows} == {"skipped"} and all(r["error"] == reason for r in rows)
    assert "world_size > 1" in skip_reason(make_config(compile="default", world_size=2), CPU)


class FakeTunable:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def test_device_levers_set_and_restore_cudnn_benchmark_and_keep_tunableops_file(monkeypatch, tmp_path):
    tunable = FakeTunable()
    monkeypatch.setattr(torch.cuda, "tunable", tunable, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    path = tunableop_file(str(tmp_path / "run"), "cuda:0")
    assert path == tmp_path / "run" / "tunableop-cuda-0.csv"
    config = make_config(conv_autotune=True, tunableop=True)
    with device_levers(config, CUDA, path) as row:
        assert torch.backends.cudnn.benchmark is True
        assert tunable.calls == [("enable", True), ("tuning_enable", True), ("set_filename", str(path))]
    assert torch.backends.cudnn.benchmark is False  # restored
    assert tunable.calls[-2:] == [("write_file",), ("enable", False)]
    assert row == {"tunableop_file": str(path)}
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    with device_levers(make_config(), CUDA) as row:  # off is set, not inherited
        assert torch.backends.cudnn.benchmark is False
    assert row == {} and torch.backends.cudnn.benchmark is True
    with device_levers(config, CPU) as row:  # nothing to set on the CPU
        assert torch.backends.cudnn.benchmark is True


def test_a_steps_one_off_cost_is_its_first_calls_beyond_steady_ones():
    raw = RawTiming(first_ms=900.0, samples_ms=[10.0, 10.0], clock="host", warmup_ms=[40.0, 10.0])
    tuned = LeverWatch(make_config(tunableop=True, conv_autotune=True)).columns(raw, 10.0)
    assert tuned == {"one_off_ms": 920.0, "one_off_kind": "cuDNN/MIOpen algorithm search + TunableOp GEMM tuning"}
    assert LeverWatch(make_config()).columns(raw, 10.0) == {}
    watch = LeverWatch(make_config(compile="default"))
    compiled = torch.compile(lambda x: torch.sin(x) + 1)
    start, end = watch.chain(None)
    compiled(torch.ones(3))
    start()
    compiled(torch.ones(3, 2))  # a new shape: compiled again, inside the window
    end()
    cols = watch.columns(raw, 10.0)
    assert cols["one_off_kind"] == "torch.compile" and cols["recompiles"] >= 1
    assert cols["graph_breaks"] == 0 and cols["compiled_graphs"] >= 1
    assert (
        compile_mode("default") is None
        and compile_mode("off") is None
        and compile_mode("max-autotune") == "max-autotune"
    )


@pytest.mark.parametrize("impl, flag", [("default", None), ("foreach", "foreach"), ("fused", "fused")])
def test_optimizer_impl(impl, flag):
    params = [torch.nn.Parameter(torch.ones(2))]
    opt = make_optimizer(params, make_config(optimizer={"impl": impl}).optimizer)
    chosen = {k for k in ("foreach", "fused") if opt.defaults.get(k)}
    assert chosen == ({flag} if flag else set())


def _row(cell: str, measurement: str, median: float, config: dict, **extra) -> dict:
    return {
        "run_id": "r",
        "cell_id": cell,
        "cell_label": cell,
        "measurement": measurement,
        "batch_size": 32 if measurement == "distill_step" else 1,
        "status": "ok",
        "median_ms": median,
        "config_json": json.dumps(config, sort_keys=True),
        "timestamp": datetime(2026, 1, 1, tzinfo=UTC),
        **extra,
    }


def test_break_even_against_the_same_cell_without_levers_and_the_report_table(tmp_path):
    from kdbench.report import render_report

    base = {"pair": {"teacher": "t", "student": "s"}, "inference": {"batch_sizes": [1]}}
    compiled = {**base, "compile": "default"}
    onnx = {**base, "inference": {"batch_sizes": [1], "runtime": "onnxruntime"}}
    rows = [
        _row("plain", "distill_step", 10.0, base),
        _row("plain", "student_inference", 2.0, base, runtime="eager"),
        _row(
            "comp",
            "distill_step",
            8.0,
            compiled,
            one_off_ms=3000.0,
            one_off_kind="torch.compile",
            graph_breaks=1,
            compiled_graphs=2,
            recompiles=0,
            compile="default",
        ),
        _row(
            "onnx",
            "student_inference",
            2.5,
            onnx,
            one_off_ms=400.0,
            one_off_kind="ONNX export + session",
            runtime="onnxruntime",
            output_check="ok: max |Δ| 1e-06",
        ),
    ]
    df = as_read(rows)
    step = df[df["cell_id"].eq("comp")].iloc[0]
    assert (step.lever_baseline_ms, step.lever_gain_ms, step.break_even_steps) == (10.0, 2.0, 1500)
    served = df[df["cell_id"].eq("onnx")].iloc[0]
    assert served.lever_gain_ms == -0.5 and pd_isna(served.break_even_steps)
    assert df[df["cell_id"].eq("plain")]["lever_gain_ms"].isna().all()
    page = render_report(df, tmp_path).read_text()
    table = page.split('<h2 id="levers">')[1].split("</table>")[0]
    assert table.count('class="lever-row"') == 2
    assert '<td class="num break-even">1,500</td>' in table and "never: not faster" in table
    assert "1 breaks, 2 graphs, 0 recompiles" in table and "ok: max |Δ| 1e-06" in table
    no_levers = render_report(as_read(rows[:2]), tmp_path / "plain").read_text()
    assert 'id="levers"' not in no_levers


def pd_isna(x) -> bool:
    import pandas as pd

    return bool(pd.isna(x))


def test_lever_columns_reach_the_stored_row():
    from kdbench.run.jobs import config_columns

    cols = config_columns(make_config(compile="reduce-overhead", optimizer={"impl": "foreach"}, graphs=True), "cuda")
    assert (cols["compile"], cols["optimizer_impl"], cols["graphs"], cols["tunableop"]) == (
        "reduce-overhead",
        "foreach",
        True,
        False,
    )


def test_levers_run_end_to_end_on_the_cpu(tmp_path, capsys):
    """compile and the optimizer impl on the step, the four serving runtimes, and a GPU-only lever skipped:
    one run, its rows and its report's lever table."""
    import pandas as pd

    from kdbench.store import read_results
    from tests.helpers import run_folder

    suite = write_suite(
        tmp_path / "levers.yaml",
        name="levers",
        backend="cpu",
        threads=1,
        defaults={
            "pair": {"teacher": "linear", "student": "linear"},
            "batch_size": 8,
            "data": {"kind": "synthetic", "shape": [1, 8, 8], "num_classes": 10},
            "timing": {"warmup": 1, "min_iters": 5, "min_time_s": 0.0},
            "inference": {"batch_sizes": [4], "teacher": False},
        },
        matrix={
            "cases": [
                {},
                {"compile": "default"},
                {"optimizer": {"impl": "foreach"}},
                {"inference": {"runtime": "compile"}},
                {"inference": {"runtime": "onnxruntime"}},
                {"inference": {"runtime": "int8"}},
                {"graphs": True},
            ]
        },
    )
    code = main(["run", str(suite), "--out", str(tmp_path / "res"), "--report-dir", str(tmp_path / "rep")])
    assert code == 0, capsys.readouterr().err
    df = read_results([run_folder(tmp_path / "res").path])
    step = df[df["measurement"].eq("distill_step")].set_index("cell_label")["status"]
    assert step.drop(index=[i for i in step.index if "graphs" in i]).eq("ok").all()
    [graphs] = [i for i in step.index if "graphs" in i]
    assert step[graphs] == "skipped" and "GPU" in df[df["cell_label"].eq(graphs)]["error"].iloc[0]
    compiled = df[df["compile"].eq("default") & df["measurement"].eq("distill_step")].iloc[0]
    assert compiled.one_off_ms > 0 and compiled.one_off_kind == "torch.compile"
    assert compiled.graph_breaks >= 0 and compiled.recompiles == 0 and compiled.lever_baseline_ms > 0
    plain = df[df["compile"].eq("off") & df["measurement"].eq("distill_step") & df["status"].eq("ok")]
    twin = plain[plain["config_json"].map(lambda j: "runtime" not in j and "impl" not in j)].iloc[0]
    net = compiled.one_off_ms - twin.cold_excess_ms  # what the plain step pays once anyway is not the compile's
    assert compiled.lever_one_off_net_ms == pytest.approx(max(0.0, net))
    if compiled.lever_gain_ms > 0:
        assert compiled.break_even_steps == math.ceil(round(compiled.lever_one_off_net_ms / compiled.lever_gain_ms, 9))
    else:
        assert pd.isna(compiled.break_even_steps)
    served = df[df["measurement"].eq("student_inference") & df["status"].eq("ok")]
    assert sorted(served["runtime"]) == ["compile", "eager", "eager", "eager", "int8", "onnxruntime"]
    served = served[served["runtime"].ne("eager")].set_index("runtime")
    for runtime in ("compile", "onnxruntime", "int8"):
        row = served.loc[runtime]
        assert row.status == "ok" and row.one_off_ms > 0 and row.output_check.startswith("ok")
        assert row.output_top1_agreement == 1.0 and pd.notna(row.lever_gain_ms)
    assert "Linear" in served.loc["int8"].notes
    foreach = df[df["optimizer_impl"].eq("foreach") & df["measurement"].eq("distill_step")].iloc[0]
    assert foreach.status == "ok" and pd.isna(foreach.one_off_ms)
    table = (tmp_path / "rep" / "index.html").read_text().split('<h2 id="levers">')[1].split("</table>")[0]
    assert table.count('class="lever-row"') == 4  # compile step, and the three served runtimes


def test_a_compile_failure_is_the_rows_error_and_the_cell_goes_on(monkeypatch):
    def broken(model, mode=None):
        def call(*args, **kwargs):
            raise RuntimeError("InductorError: C++ compile error: g++ not found")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    config = make_config(
        compile="default",
        pair={"teacher": "linear", "student": "linear"},
        data={"shape": [1, 4, 4], "num_classes": 4},
        inference={"batch_sizes": [2, 4], "teacher": False, "runtime": "compile"},
    )
    rows = measure_cell(Cell(0, "c", config), CPU, ModelCache())
    assert [(r["measurement"], r["status"]) for r in rows] == [
        ("distill_step", "failed"),
        ("student_inference", "failed"),
        ("student_inference", "failed"),
    ]
    assert all("g++ not found" in r["error"] for r in rows)
    eager = make_config(
        compile="default",
        pair={"teacher": "linear", "student": "linear"},
        data={"shape": [1, 4, 4], "num_classes": 4},
        inference={"batch_sizes": [2], "teacher": False},
    )
    step, served = measure_cell(Cell(1, "d", eager), CPU, ModelCache())
    assert step["status"] == "failed" and served["status"] == "ok"  # the eager student still serves
