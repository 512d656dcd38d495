"""Every cell explains its time: phases, FLOPs, memory, utilisation, telemetry, traces, probes."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from kdbench.cli import main
from kdbench.core.names import PHASES, REMAINDER_COLUMN
from kdbench.core.schema import ENVIRONMENT_COLUMNS
from kdbench.hw.backends import Backend, resolve
from kdbench.hw.environment import capture, kernel_caches
from kdbench.measure.step import phase_columns, step_flops
from kdbench.measure.telemetry import TelemetrySampler, telemetry_columns
from kdbench.measure.timing import RawTiming
from kdbench.models import build_model
from kdbench.store import read_results
from tests.support.helpers import make_config, make_step, run_folder, write_suite
from tests.support.paths import ROOT
from tests.support.suites import tiny_suite

CPU = resolve("cpu")


class ConvNet(nn.Module):
    """conv 3x3 (padding 1) -> flatten -> linear: FLOPs known in closed form."""

    def __init__(self, num_classes=10, in_shape=(3, 8, 8), channels=4):
        super().__init__()
        c, h, w = in_shape
        self.conv = nn.Conv2d(c, channels, 3, padding=1)
        self.fc = nn.Linear(channels * h * w, num_classes)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def conv_net(num_classes, in_shape):
    return ConvNet(num_classes, tuple(in_shape))


def test_flops_of_a_linear_step_are_analytic():
    b, d, c = 4, 1 * 8 * 8, 10
    config = make_config(pair={"teacher": "linear", "student": "linear"}, data={"shape": [1, 8, 8], "num_classes": c})
    step = make_step(config, (build_model("linear", c, (1, 8, 8)), build_model("linear", c, (1, 8, 8))))
    flops = step_flops(step)
    mm = 2 * b * d * c
    assert flops["teacher_forward_flops"] == mm
    assert flops["student_flops"] == 2 * mm  # forward + grad of the weight (the input needs none)
    assert flops["flops"] == 3 * mm


def test_flops_of_a_conv_step_are_analytic():
    b, (ch, h, w), k, c = 4, (3, 8, 8), 4, 10
    config = make_config(pair={"teacher": "linear", "student": "linear"}, data={"shape": [ch, h, w], "num_classes": c})
    step = make_step(config, (ConvNet(c, (ch, h, w), k), ConvNet(c, (ch, h, w), k)))
    conv = 2 * b * k * h * w * ch * 3 * 3
    fc = 2 * b * (k * h * w) * c
    flops = step_flops(step)
    assert flops["teacher_forward_flops"] == conv + fc
    # student: forward (conv + fc), backward: fc's weight and input grads, conv's weight grad only
    assert flops["student_flops"] == (conv + fc) + (2 * fc + conv)
    cached = make_step(
        config.model_copy(update={"teacher": config.teacher.model_copy(update={"mode": "cached"})}),
        (ConvNet(c, (ch, h, w), k), ConvNet(c, (ch, h, w), k)),
    )
    f = step_flops(cached)
    assert f["teacher_forward_flops"] is None and f["flops"] == f["student_flops"] == 2 * conv + 3 * fc


def test_phases_sum_to_the_step_within_the_remainder():
    config = make_config(pair={"teacher": "resnet8", "student": "resnet8"}, method="kd+at")
    step = make_step(config, (build_model("resnet8", 10, (3, 16, 16)), build_model("resnet8", 10, (3, 16, 16))))
    from kdbench.measure.rows import profiled_loop

    raw, _, _ = profiled_loop(step, config, CPU, config.batch_size, None)
    phases = step.phase_ms(len(raw.samples_ms))
    assert list(phases) == [p.name for p in PHASES] and all(len(v) == len(raw.samples_ms) for v in phases.values())
    for i, total in enumerate(raw.samples_ms):
        parts = sum(v[i] for v in phases.values())
        assert 0 < parts <= total  # the phase stamps lie inside the step's own stamps
    row = phase_columns(step, raw)
    assert set(row) == {p.column for p in PHASES} | {REMAINDER_COLUMN}
    assert row[REMAINDER_COLUMN] >= 0
    assert all(row[p.column] > 0 for p in PHASES)


def test_cached_teacher_phase_is_empty_and_the_forward_phases_reflect_it():
    config = make_config(pair={"teacher": "resnet20", "student": "resnet8"}, teacher={"mode": "cached"})
    step = make_step(config, (build_model("resnet20", 10, (3, 16, 16)), build_model("resnet8", 10, (3, 16, 16))))
    for _ in range(3):
        step()
    phases = step.phase_ms(3)
    # nothing runs between the first two stamps when the teacher is cached
    assert max(phases["teacher_forward"]) < min(phases["student_forward"])


MEMORY_SCRIPT = """
import json, sys
import torch
from kdbench.hw.backends import resolve
from kdbench.config.plan import Cell
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from tests.support.helpers import make_config
torch.set_num_threads(1)
bs = int(sys.argv[1])
config = make_config(pair={"teacher": "resnet8", "student": "resnet8"}, batch_size=bs,
                     data={"shape": [3, 32, 32], "num_classes": 10}, inference={"batch_sizes": []})
row = measure_cell(Cell(0, "m", config), resolve("cpu"), ModelCache())[0]
print(json.dumps({k: row[k] for k in ("status", "memory_kind", "peak_memory_bytes", "optimizer_state_bytes")}))
"""


@pytest.mark.slow
def test_memory_peaks_are_positive_and_grow_with_batch_size():
    # One fresh process per batch size: a process's resident memory keeps what earlier work left.
    peaks = {}
    for bs in (2, 128):
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_SCRIPT, str(bs)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        peaks[bs] = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(p["status"] == "ok" and p["memory_kind"] == "rss_hwm" for p in peaks.values())
    assert peaks[2]["peak_memory_bytes"] > 0
    # resnet8 at 32x32 keeps ~30 activations of 16 x 32 x 32 floats per sample: ~2 MB a sample
    assert peaks[128]["peak_memory_bytes"] - peaks[2]["peak_memory_bytes"] > 100 * 2**20
    n_params = sum(p.numel() for p in build_model("resnet8", 10, (3, 32, 32)).parameters())
    # AdamW keeps two fp32 moments per parameter, plus a step counter per parameter tensor
    assert peaks[2]["optimizer_state_bytes"] >= 2 * 4 * n_params


def test_simulated_nvml_readings_flow_into_energy_per_step():
    class FakeNvml:
        NVML_CLOCK_GRAPHICS, NVML_TEMPERATURE_GPU = 0, 0

        def nvmlInit(self):
            pass

        def nvmlShutdown(self):
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return uuid

        def nvmlDeviceGetPowerUsage(self, h):
            return 300_000  # mW

        def nvmlDeviceGetClockInfo(self, h, kind):
            return 1_800

        def nvmlDeviceGetTemperature(self, h, kind):
            return 70

        def nvmlDeviceGetUtilizationRates(self, h):
            return type("U", (), {"gpu": 95})()

    from kdbench.measure.telemetry import DeviceIds

    sampler = TelemetrySampler(Backend("cuda", torch.device("cuda", 0)), library=FakeNvml(), ids=DeviceIds("u-1"))
    with sampler:
        pass
    # Replace the samples with a known trace: 300 W throughout, timed window 10.0 .. 12.0 s.
    sampler.samples = [(t, 300.0, 1800.0, 70.0, 95.0) for t in (9.0, 10.0, 10.5, 11.0, 12.0, 13.0)]
    raw = RawTiming(50.0, [100.0] * 20, "device_event", window_s=(10.0, 12.0))
    cols = telemetry_columns(sampler.result(len(raw.samples_ms), 64, raw.window_s))
    assert cols["telemetry"] == "pynvml" and cols["telemetry_device"] == "GPU-u-1"
    assert cols["energy_per_step_j"] == pytest.approx(300.0 * 2.0 / 20)  # 600 J over 20 steps
    assert cols["energy_source"] == "sampled power"  # this fake has no energy counter
    assert cols["samples_per_joule"] == pytest.approx(20 * 64 / 600.0)
    assert cols["power_w_mean"] == 300.0 and cols["clock_mhz_mean"] == 1800.0
    assert cols["temperature_c_max"] == 70.0 and cols["gpu_util_pct_mean"] == 95.0


def test_no_telemetry_on_the_cpu_records_why_and_no_numbers():
    with TelemetrySampler(CPU) as s:
        pass
    cols = telemetry_columns(s.result(10, 8))
    assert cols["telemetry"].startswith("unavailable: ")
    assert all(v is None for k, v in cols.items() if k != "telemetry")


def test_kernel_cache_state_is_read_from_the_documented_places(tmp_path):
    assert kernel_caches("cpu", {}, tmp_path) == {"miopen_cache_warm": None, "tunableop_cache_warm": None}
    assert kernel_caches("rocm", {}, tmp_path)["miopen_cache_warm"] is False
    (tmp_path / ".config" / "miopen").mkdir(parents=True)
    (tmp_path / ".config" / "miopen" / "gfx942_304.HIP.3_2_0.udb").write_text("x")
    assert kernel_caches("rocm", {}, tmp_path)["miopen_cache_warm"] is True
    tunable = {"PYTORCH_TUNABLEOP_ENABLED": "1", "PYTORCH_TUNABLEOP_FILENAME": str(tmp_path / "tune.csv")}
    assert kernel_caches("cuda", tunable, tmp_path)["tunableop_cache_warm"] is False
    (tmp_path / "tune0.csv").write_text("Validator")
    assert kernel_caches("cuda", tunable, tmp_path)["tunableop_cache_warm"] is True


def test_environment_record_has_the_speed_knobs():
    env = capture(CPU)
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    from kdbench.hw.backends import math_flags

    assert env["float32_matmul_precision"] == math_flags()["float32_matmul_precision"]
    assert env["miopen_cache_warm"] is None  # not a ROCm build
    assert env["device_name"] and env["cpu_threads"] == torch.get_num_threads()
    # the schema's environment group is exactly what is captured (the report's environment table shows it)
    assert sorted(env) == sorted(ENVIRONMENT_COLUMNS)


SUITE = tiny_suite(
    name="prof",
    defaults={
        "pair": {"teacher": "resnet8", "student": "linear"},
        "batch_size": 8,
        "data": {"kind": "synthetic", "shape": [3, 8, 8], "num_classes": 10},
        "timing": {"warmup": 1},
        "inference": {"batch_sizes": [2]},
    },
)


@pytest.mark.slow
def test_probe_then_run_reports_utilisation_and_traces(tmp_path, capsys):
    out = tmp_path / "res"
    threads = torch.get_num_threads()
    assert main(["probe", "--out", str(out), "--size", "64", "--min-time", "0.01", "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads  # the probe's thread count does not leak into the caller
    probes = list((out / "probes").glob("probe-*.parquet"))
    assert len(probes) == 1
    probe = pq.read_table(probes[0]).to_pylist()
    fp32 = next(r for r in probe if r["kind"] == "matmul" and r["dtype"] == "fp32")
    assert fp32["value"] > 0 and fp32["backend"] == "cpu"

    suite = write_suite(tmp_path / "prof.yaml", **SUITE)
    assert main(["run", str(suite), "--out", str(out), "--report-dir", str(tmp_path / "rep"), "--profile"]) == 0
    run = run_folder(out)  # the probes/ and traces/ folders are not taken for runs
    rows = {r["measurement"]: r for r in read_results([run.path]).to_dict("records")}
    step = rows["distill_step"]
    assert step["ceiling_probe_id"] == probes[0].stem
    assert step["ceiling_tflops"] == pytest.approx(fp32["value"])
    assert step["ceiling_utilization"] == pytest.approx(step["achieved_tflops"] / fp32["value"])
    assert step["achieved_tflops"] == pytest.approx(step["flops"] / (step["median_ms"] / 1e3) / 1e12)
    assert step["flops"] > 0 and step["peak_memory_bytes"] > 0 and step["optimizer_state_bytes"] > 0
    assert step["time_to_steady_ms"] >= step["first_ms"] and step["steady_after_iters"] >= 1
    assert step["telemetry"].startswith("unavailable")
    trace = json.loads(Path(step["trace_file"]).read_text())
    assert trace["traceEvents"]
    top = json.loads(step["top_ops"])
    assert top and all(t["self_ms_per_call"] >= 0 and t["op"] for t in top)
    assert rows["student_inference"]["flops"] == 2 * 2 * (3 * 8 * 8) * 10  # linear student, batch 2
    assert "probe" in capsys.readouterr().out
    # a report over the whole folder skips probes/ (another schema)
    assert main(["report", str(out), "--out", str(tmp_path / "rep2")]) == 0
    assert "Where the step" in (tmp_path / "rep2" / "index.html").read_text()


class RecordingClock:
    """A device-event-like clock: stamps are tokens; times are only read after sync()."""

    name = "fake_event"

    def __init__(self):
        self.log = []
        self.synced = False

    def stamp(self):
        self.log.append("stamp")
        self.synced = False
        return len(self.log)

    def elapsed_ms(self, a, b):
        assert self.synced, "an event was read before the device was synchronised"
        return float(b - a)

    def sync(self):
        self.log.append("sync")
        self.synced = True


def test_phase_stamps_add_no_sync_inside_the_step_and_are_read_after():
    config = make_config(pair={"teacher": "resnet8", "student": "resnet8"})
    step = make_step(config, (build_model("resnet8", 10, (3, 16, 16)), build_model("resnet8", 10, (3, 16, 16))))
    clock = RecordingClock()
    step.clock = clock
    for _ in range(4):
        step()
    assert clock.log == ["stamp"] * 6 * 4  # six boundaries per step, never a sync
    phases = step.phase_ms(3)  # the last three calls
    assert clock.log[-1] == "sync" and clock.log.count("sync") == 1
    assert all(v == [1.0, 1.0, 1.0] for v in phases.values())  # consecutive stamps, one apart


def test_a_profiler_that_cannot_start_costs_the_trace_not_the_row(tmp_path, monkeypatch):
    import torch.profiler

    from kdbench.measure.step import MeasureOptions, measure_distill_step
    from kdbench.workloads.vision import VISION

    def refused(*args, **kwargs):
        raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES\nmore")

    monkeypatch.setattr(torch.profiler, "profile", refused)
    config = make_config(pair={"teacher": "linear", "student": "linear"}, data={"shape": [1, 4, 4], "num_classes": 4})
    teacher, student = build_model("linear", 4, (1, 4, 4)), build_model("linear", 4, (1, 4, 4))
    row = measure_distill_step(VISION, teacher, student, config, CPU, None, MeasureOptions(trace_dir=str(tmp_path)))
    assert row["status"] == "ok" and row["median_ms"] > 0 and row["flops"] > 0
    assert row["trace_error"] == "the profiler failed: RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"
    assert "trace_file" not in row and not list(tmp_path.iterdir())


def test_driver_version_from_the_driver_files_or_the_in_box_kernel(monkeypatch):
    import platform
    from pathlib import Path

    from kdbench.hw.environment import driver_version

    files = {"/proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5"}

    def read_text(self, *a, **k):
        if str(self) in files:
            return files[str(self)]
        raise OSError("no such file")

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(Path, "is_dir", lambda self: str(self) == "/sys/module/amdgpu")
    assert driver_version("cuda") == "550.54.15"
    assert driver_version("rocm") == f"in-box amdgpu (kernel {platform.release()})"  # no DKMS version file
    files["/sys/module/amdgpu/version"] = "6.8.5"
    assert driver_version("rocm") == "6.8.5"
    assert driver_version("cpu") is None
