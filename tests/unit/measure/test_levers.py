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
from kdbench.core.schema import Row
from kdbench.distill.step import compile_mode, make_optimizer
from kdbench.hw.backends import Backend
from kdbench.measure import levers
from kdbench.measure.levers import LeverWatch, device_levers, skip_reason, tunableop_file
from kdbench.measure.timing import RawTiming
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from tests.support.helpers import as_read, make_config, simulated_gpu, write_suite
from tests.support.rows import result_row
from tests.support.suites import tiny_suite

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
    """torch.cuda.tunable, recording its calls; ``write_file`` only where the simulated torch has it (~2.8 and
    older), raising when asked to."""

    def __init__(self, has_write_file=True, write_raises=None):
        self.calls = []
        self.write_raises = write_raises
        if has_write_file:
            self.write_file = self._write

    def __getattr__(self, name):
        if name in ("enable", "tuning_enable", "set_filename"):
            return lambda *args: self.calls.append((name, *args))
        raise AttributeError(name)  # torch 2.14's module has no write_file: getattr raises

    def _write(self):
        self.calls.append(("write_file",))
        if self.write_raises:
            raise self.write_raises


@pytest.fixture
def fresh_tunable_state(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


def test_device_levers_set_and_restore_cudnn_benchmark_and_keep_tunableops_file(
    monkeypatch, tmp_path, fresh_tunable_state
):
    tunable = FakeTunable()
    monkeypatch.setattr(torch.cuda, "tunable", tunable, raising=False)
    path = tunableop_file(str(tmp_path / "run"), "NVIDIA H200")
    assert path == tmp_path / "run" / "_tunableop-nvidia-h200.csv"
    config = make_config(conv_autotune=True, tunableop=True)
    with device_levers(config, CUDA, path) as row:
        assert torch.backends.cudnn.benchmark is True
        assert tunable.calls == [("set_filename", str(path)), ("enable", True), ("tuning_enable", True)]
    assert torch.backends.cudnn.benchmark is False  # restored
    assert tunable.calls[-3:] == [("tuning_enable", False), ("enable", False), ("write_file",)]
    assert row == {"tunableop_file": str(path), "notes": levers.TUNABLEOP_SCOPE}
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    with device_levers(make_config(), CUDA) as row:  # off is set, not inherited
        assert torch.backends.cudnn.benchmark is False
    assert row == {} and torch.backends.cudnn.benchmark is True
    with device_levers(config, CPU) as row:  # nothing to set on the CPU
        assert torch.backends.cudnn.benchmark is True


@pytest.mark.parametrize("has_write_file", [False, True], ids=["torch-2.14-no-write_file", "torch-2.8-write_file"])
def test_tunableop_is_switched_off_whatever_fails_and_the_file_is_written_where_torch_can(
    monkeypatch, tmp_path, fresh_tunable_state, has_write_file
):
    # G1: torch 2.14 has no tunable.write_file: calling it raised in the finally, so enable(False) was never
    # reached and TunableOp stayed on for every later cell of the worker
    tunable = FakeTunable(has_write_file=has_write_file)
    monkeypatch.setattr(torch.cuda, "tunable", tunable, raising=False)
    path = tmp_path / "tunableop-gpu.csv"
    config = make_config(tunableop=True, conv_autotune=True)
    with pytest.raises(ValueError, match="the step failed"), device_levers(config, CUDA, path) as row:
        raise ValueError("the step failed")
    assert ("enable", False) in tunable.calls and ("tuning_enable", False) in tunable.calls
    assert torch.backends.cudnn.benchmark is False
    assert row["tunableop_file"] == str(path)
    if has_write_file:
        assert tunable.calls[-1] == ("write_file",) and row["notes"] == levers.TUNABLEOP_SCOPE
    else:
        # L12: torch 2.14 appends each tuned GEMM to the file as it is tuned (realtime append), not at exit
        assert "appends each GEMM to tunableop-gpu.csv as it is tuned (this torch has no write_file" in row["notes"]
        assert "exits" not in row["notes"]
    broken = FakeTunable(write_raises=OSError("disk full"))
    monkeypatch.setattr(torch.cuda, "tunable", broken, raising=False)
    with device_levers(make_config(tunableop=True), CUDA, path) as row:
        pass
    assert broken.calls[-2:] == [("enable", False), ("write_file",)]
    assert "could not write tunableop-gpu.csv: OSError: disk full" in row["notes"]


def test_tunings_from_an_earlier_run_or_cell_are_said(monkeypatch, tmp_path, fresh_tunable_state):
    # G11: a results file left from an earlier run (or tunings an earlier cell of this worker made) make the
    # one-off cost ~0: the rows say so
    monkeypatch.setattr(torch.cuda, "tunable", FakeTunable(), raising=False)
    path = tmp_path / "tunableop-gpu.csv"
    with device_levers(make_config(tunableop=True), CUDA, path) as first:
        pass
    assert first["notes"] == levers.TUNABLEOP_SCOPE  # a fresh file, a fresh process
    path.write_text("Validator,PT_VERSION,2.14.1\n")
    with device_levers(make_config(tunableop=True), CUDA, path) as second:
        pass
    assert "started from the tunings already in tunableop-gpu.csv" in second["notes"]
    assert "an earlier cell of this worker process tuned GEMMs" in second["notes"]
    assert "GEMMs only" in second["notes"]


def test_tunableops_file_is_named_after_the_device_kind(monkeypatch):
    # G11: it was named after torch's device index ("cuda-0") whatever the GPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct MI300X")
    assert levers.device_kind(CUDA) == "AMD Instinct MI300X"
    assert tunableop_file("r", levers.device_kind(CUDA)).name == "_tunableop-amd-instinct-mi300x.csv"
    assert levers.device_kind(simulated_gpu("rocm")) == "rocm" and levers.device_kind(CPU) == "cpu"


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


def _row(cell: str, measurement: str, median: float, config: dict, **extra) -> Row:
    """A row of ``cell`` (its step at batch size 32, its serving at 1) from the resolved ``config``."""
    return result_row(
        cell_id=cell,
        measurement=measurement,
        batch_size=32 if measurement == "distill_step" else 1,
        median_ms=median,
        config_json=json.dumps(config, sort_keys=True),
        timestamp=datetime(2026, 1, 1, tzinfo=UTC),
        **extra,
    )


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
    from tests.support.helpers import run_folder

    levers = tiny_suite(
        name="levers",
        defaults={
            "batch_size": 8,
            "data": {"kind": "synthetic", "shape": [1, 8, 8], "num_classes": 10},
            "timing": {"warmup": 1, "min_iters": 5},
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
    suite = write_suite(tmp_path / "levers.yaml", **levers)
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


def test_compiled_measurements_release_their_graphs_before_the_next_ones_memory_is_watched(monkeypatch):
    # G7: a compiled cell's CUDA graph pool outlived step.close() until the next torch._dynamo.reset(), so it
    # counted in the next measurements' peak_reserved_bytes.  G10: inductor's compile workers are ended after
    # serve() compiles, before the forward is timed.
    import kdbench.measure.rows as rows_module
    import kdbench.measure.step as step_module
    import kdbench.workloads.vision as vision_module
    from kdbench.measure.runtimes import Served

    events = []
    real_meter = rows_module.MemoryMeter

    class Meter(real_meter):
        def __enter__(self):
            events.append("memory watched")
            return super().__enter__()

    real_serve = vision_module.serve

    def serve(*args, **kwargs):
        served = real_serve(*args, **kwargs)
        events.append("served")
        return served

    monkeypatch.setattr(rows_module, "MemoryMeter", Meter)
    monkeypatch.setattr(vision_module, "serve", serve)
    for module in (step_module, vision_module):
        monkeypatch.setattr(module, "release_compiled", lambda backend: events.append("released"))
    monkeypatch.setattr(vision_module, "quiesce_compile_workers", lambda: events.append("workers ended"))
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: model)  # the order, not inductor
    config = make_config(
        compile="default",
        pair={"teacher": "linear", "student": "linear"},
        data={"shape": [1, 4, 4], "num_classes": 4},
        inference={"batch_sizes": [2], "runtime": "compile"},
    )
    rows = measure_cell(Cell(0, "c", config), CPU, ModelCache())
    assert [r["status"] for r in rows] == ["ok"] * 3
    # the step, released; the student served compiled, workers ended, timed, released; the teacher (eager)
    assert events == [
        "memory watched",
        "released",
        "served",
        "workers ended",
        "memory watched",
        "released",
        "memory watched",
    ]
    assert Served(lambda: None, "compile", 0.0, "torch.compile (default)", None, compiled=True).compiled


def test_eager_runs_compiled_callables_eagerly_with_and_without_compiler_stances(monkeypatch):
    # torch >= 2.6 has torch.compiler.set_stance; older releases only dynamo's disable switch: each branch
    from torch._dynamo.utils import counters

    from kdbench.measure.levers import eager

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: x + 1)
    with eager():
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    monkeypatch.delattr(torch.compiler, "set_stance")
    with eager():
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert counters["frames"]["ok"] == 0  # ran as Python both times, never compiled
