"""FLOPs, datasheet peaks, memory, optimizer state, telemetry (fake libraries) and ceiling probes
(kdbench.measure.{flops,memory,telemetry,probe}, kdbench.core.devices, kdbench.store.probes)."""

from __future__ import annotations

import math
import mmap
import re
import threading
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from kdbench.core.devices import CATALOGUE, datasheet_peak
from kdbench.core.errors import KdbenchError
from kdbench.core.worker_state import current
from kdbench.hw.backends import Backend
from kdbench.measure import memory, probe, telemetry
from kdbench.measure.flops import count_flops
from kdbench.measure.memory import MemoryMeter, optimizer_state_bytes
from kdbench.measure.probe import measure_ceilings, probe_env
from kdbench.measure.telemetry import TelemetrySampler
from kdbench.store import probes
from kdbench.store.probes import latest_ceiling, write_probe

MiB = 2**20
CUDA0 = Backend("cuda", torch.device("cuda", 0))
ROCM0 = Backend("rocm", torch.device("cuda", 0))

# --------------------------------------------------------------------------- FLOPs

LIN_MM = 2 * 8 * 64 * 32  # one (8x64) @ (64x32) product; the bias add counts 0
CONV = 2 * 2 * 8 * 16 * 16 * 3 * 3 * 3  # 2 * N * Cout * H * W * Cin * k * k


def test_linear_forward_flops_are_one_matmul():
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(64, 32, bias=True), torch.randn(8, 64)
    assert count_flops(lambda: lin(x)) == LIN_MM == 32768


def test_linear_backward_without_input_grad_adds_only_grad_weight():
    lin, x = torch.nn.Linear(64, 32), torch.randn(8, 64)
    assert count_flops(lambda: lin(x).sum().backward()) == 2 * LIN_MM
    xg = torch.randn(8, 64, requires_grad=True)  # grad_input is a third matmul of the same size
    assert count_flops(lambda: lin(xg).sum().backward()) == 3 * LIN_MM


def test_conv_forward_and_backward_flops():
    conv, x = torch.nn.Conv2d(3, 8, 3, padding=1), torch.randn(2, 3, 16, 16)
    assert count_flops(lambda: conv(x)) == CONV == 221184
    assert count_flops(lambda: conv(x).sum().backward()) == 2 * CONV
    xg = torch.randn(2, 3, 16, 16, requires_grad=True)
    assert count_flops(lambda: conv(xg).sum().backward()) == 3 * CONV


@pytest.mark.parametrize("groups", [1, 4, 16])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_grouped_convolution_backward_counts_what_it_executes(groups, transposed):
    """Torch's formula counts a grouped convolution's weight gradient ``groups`` times over; kdbench's counts it as
    the forward's work: with the input's gradient, the backward of a stride-1 convolution is twice its forward for
    any groups (16 channels in 16 groups: a depthwise convolution)."""
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    w = torch.randn(16, 16 // groups, 3, 3, requires_grad=True)

    def forward():
        if transposed:
            return torch.nn.functional.conv_transpose2d(x, w, None, 1, 1, 0, groups)
        return torch.nn.functional.conv2d(x, w, None, 1, 1, 1, groups)

    once = count_flops(forward)
    assert once == 2 * 2 * 8 * 8 * 9 * 16 * (16 // groups)  # 2 per multiply-add, per output element of each image
    assert count_flops(lambda: forward().sum().backward()) == 3 * once


# --------------------------------------------------------------------------- datasheet peaks


@pytest.mark.parametrize(
    "name, canonical, fp32, bf16",
    [
        ("AMD Instinct MI300X", "MI300X", 163.4, 1307.4),
        ("AMD Instinct MI300X VF", "MI300X", 163.4, 1307.4),
        ("AMD Instinct MI250X/MI250", "MI250X (per GCD)", 23.95, 191.5),
        ("AMD Instinct MI250X", "MI250X (per GCD)", 23.95, 191.5),
        ("AMD Instinct MI210", "MI210", 22.6, 181.0),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 67.0, 989.4),
        ("NVIDIA H100 PCIe", "H100 PCIe", 51.0, 756.0),
        ("NVIDIA H200", "H200 SXM", 67.0, 989.4),
        ("NVIDIA A100-SXM4-80GB", "A100", 19.5, 312.0),
        ("NVIDIA A100-SXM4-40GB", "A100", 19.5, 312.0),
        ("NVIDIA A100-PCIE-40GB", "A100", 19.5, 312.0),
        ("NVIDIA A100 80GB PCIe", "A100", 19.5, 312.0),
        ("NVIDIA L4", "L4", 30.3, 121.0),
        ("nvidia  h100   pcie", "H100 PCIe", 51.0, 756.0),  # case and spacing do not matter
    ],
)
def test_datasheet_peak_known_names(name, canonical, fp32, bf16):
    assert datasheet_peak(name, "fp32") == (canonical, pytest.approx(fp32))
    assert datasheet_peak(name, "bf16") == (canonical, pytest.approx(bf16))
    assert datasheet_peak(name, "fp16") == (canonical, pytest.approx(bf16))  # fp16 == bf16 on all of these


def test_t4_has_fp16_but_no_bf16_peak():
    assert datasheet_peak("Tesla T4", "fp32") == ("T4", 8.1)
    assert datasheet_peak("Tesla T4", "fp16") == ("T4", 65.0)
    assert datasheet_peak("Tesla T4", "bf16") is None


@pytest.mark.parametrize(
    "name",
    [
        "AMD Instinct MI300A",
        "AMD Instinct MI325X",
        "NVIDIA H100 NVL",
        "NVIDIA H200 NVL",
        "NVIDIA H100",
        "NVIDIA A10",
        "NVIDIA A100X",
        "NVIDIA GeForce RTX 4090",
        "Intel(R) Xeon(R) Platinum 8480+",
        "AMD EPYC 9654 96-Core Processor",
        "",
    ],
)
def test_unknown_names_have_no_peak(name):
    assert datasheet_peak(name, "fp32") is None
    assert datasheet_peak(name, "bf16") is None


def test_peak_table_shape_and_unknown_dtype():
    assert {card.part for card in CATALOGUE if card.reported} == {
        "MI300X",
        "MI250X (per GCD)",
        "MI210",
        "H200 SXM",
        "H100 SXM",
        "H100 PCIe",
        "A100",
        "L4",
        "T4",
    }
    assert all(set(card.peaks) == {"fp32", "tf32", "fp16", "bf16"} for card in CATALOGUE)
    with pytest.raises(KdbenchError, match="unknown dtype 'fp8'"):
        datasheet_peak("NVIDIA L4", "fp8")


@pytest.mark.parametrize(
    "name, tf32",
    [
        ("NVIDIA H200", 494.7),
        ("NVIDIA H100 80GB HBM3", 494.7),
        ("NVIDIA H100 PCIe", 378.0),
        ("NVIDIA A100-SXM4-80GB", 156.0),
        ("NVIDIA L4", 60.0),
        ("AMD Instinct MI300X", 653.7),
    ],
)
def test_tf32_peaks_are_the_tensor_core_figures_above_fp32(name, tf32):
    _, peak = datasheet_peak(name, "tf32")
    assert peak == pytest.approx(tf32) and peak > datasheet_peak(name, "fp32")[1]


def test_devices_without_tf32_have_no_tf32_peak():
    assert datasheet_peak("Tesla T4", "tf32") is None and datasheet_peak("AMD Instinct MI210", "tf32") is None


# --------------------------------------------------------------------------- memory


def _rss_threads():
    return [t for t in threading.enumerate() if t.name == "kdbench-rss"]


def fresh_ones(nbytes: int) -> torch.Tensor:
    """A tensor of ones on newly mapped pages.  torch.ones may reuse memory the allocator
    already holds resident (it does after some other test files), which RSS cannot see."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).fill_(1)


@pytest.fixture(params=["rss_hwm", "rss"])
def cpu_mode(request, monkeypatch):
    """Both CPU paths: the kernel's high-water mark, and the sampling fallback."""
    if request.param == "rss":
        monkeypatch.setattr(memory, "_reset_hwm", lambda: False)
    return request.param


def test_cpu_meter_sees_a_big_allocation(cpu, cpu_mode):
    with MemoryMeter(cpu) as meter:
        big = fresh_ones(200 * MiB)  # fill_ writes every page: resident
    usage = meter.result()
    assert big[-1].item() == 1
    assert usage.kind == cpu_mode and usage.peak_reserved_bytes is None
    assert meter.rss_before > 0
    assert usage.peak_bytes >= meter.rss_before + 180 * MiB
    assert usage.growth_bytes >= 180 * MiB
    assert usage.peak_bytes >= meter.rss_before + usage.growth_bytes
    assert _rss_threads() == []
    del big


def test_high_water_mark_catches_a_freed_spike(cpu):
    with MemoryMeter(cpu, interval_s=10.0) as meter:
        spike = fresh_ones(150 * MiB)
        del spike  # gone before the block ends
    usage = meter.result()
    assert usage.kind == "rss_hwm"
    assert usage.peak_bytes >= meter.rss_before + 140 * MiB
    assert usage.growth_bytes < 20 * MiB


def test_cpu_meter_larger_allocation_larger_peak(cpu, cpu_mode):
    rises = []
    for size in (40 * MiB, 240 * MiB):
        with MemoryMeter(cpu) as meter:
            t = fresh_ones(size)
        rises.append(meter.result().peak_bytes - meter.rss_before)
        del t
    assert rises[0] >= 30 * MiB
    assert rises[1] >= 220 * MiB
    assert rises[1] > rises[0] + 150 * MiB


def test_cpu_meter_stops_its_thread_on_error(cpu, monkeypatch):
    monkeypatch.setattr(memory, "_reset_hwm", lambda: False)
    with pytest.raises(ValueError), MemoryMeter(cpu, interval_s=0.001):
        assert len(_rss_threads()) == 1
        raise ValueError("boom")
    assert _rss_threads() == []


def test_cpu_meter_result_before_exit_is_an_error(cpu):
    with pytest.raises(RuntimeError, match="after the `with` block"):
        MemoryMeter(cpu).result()


def test_cuda_meter_reads_allocator_counters_after_clearing_what_earlier_work_left(monkeypatch):
    import gc

    calls = []
    allocated = iter([1_000, 5_000])  # at entry, at exit
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("max_alloc", d)) or 9_000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 12_000)
    monkeypatch.setattr(memory, "_reset_hwm", lambda: calls.append("reset_hwm") or True)
    monkeypatch.setattr(memory, "_hwm_bytes", lambda: 64 * 2**40)  # the host's high-water mark: 64 TiB
    with MemoryMeter(CUDA0) as meter:
        # unreferenced cycles collected, the device idle, the cache emptied, and only then the peaks reset
        assert calls == ["gc", "sync", "empty_cache", ("reset", torch.device("cuda", 0)), "reset_hwm"]
    usage = meter.result()
    # footprint: peak - at entry; the host's peak read beside the device's
    assert usage == memory.MemoryUsage("device", 9_000, 12_000, 4_000, 8_000, host_peak_bytes=64 * 2**40)
    assert calls[-1] == ("max_alloc", torch.device("cuda", 0))
    assert meter.allocated_before == 1_000 and meter.rss_before is None
    assert _rss_threads() == []
    assert memory.memory_columns(usage)["host_peak_bytes"] == 64 * 2**40
    # a kernel without a resettable high-water mark: no host peak on a GPU row (no sampling thread either)
    allocated = iter([1_000, 5_000])
    monkeypatch.setattr(memory, "_reset_hwm", lambda: False)
    with MemoryMeter(CUDA0) as meter:
        pass
    assert meter.result().host_peak_bytes is None and _rss_threads() == []


def test_a_finished_step_leaves_nothing_behind_for_the_next_measurement(monkeypatch):
    # What made a GPU inference measured after a step peak higher than one measured before it:
    # a Distiller <-> optimizer reference cycle, stale gradients and forgotten feature hooks.
    import weakref

    from kdbench.measure.step import measure_distill_step
    from kdbench.models import build_model
    from kdbench.workloads.vision import VISION
    from tests.support.helpers import make_config

    optimizers = []
    adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: optimizers.append(adamw(*a, **k)) or optimizers[-1])
    config = make_config(pair={"teacher": "resnet8", "student": "resnet8"}, method="kd+at")
    teacher, student = build_model("resnet8", 10, (3, 16, 16)), build_model("resnet8", 10, (3, 16, 16))
    row = measure_distill_step(VISION, teacher, student, config, Backend("cpu", torch.device("cpu")), None)
    assert row["status"] == "ok" and row["memory_footprint_bytes"] is not None
    gone = weakref.ref(optimizers.pop())  # its state (two moments per weight) goes with the step
    assert gone() is None  # freed by reference counting alone: no cycle waits for the collector
    assert all(p.grad is None for p in student.parameters())
    assert not any(m._forward_hooks for m in [*teacher.modules(), *student.modules()])


def test_optimizer_state_bytes_adamw():
    lin = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(lin.parameters())
    assert optimizer_state_bytes(opt) == 0
    lin(torch.randn(8, 64)).sum().backward()
    opt.step()
    param_bytes = (64 * 32 + 32) * 4
    states = list(opt.state.values())
    assert len(states) == 2 and all({"exp_avg", "exp_avg_sq"} <= set(s) for s in states)
    step_bytes = sum(s["step"].nbytes for s in states if torch.is_tensor(s["step"]))
    assert optimizer_state_bytes(opt) == 2 * param_bytes + step_bytes
    assert step_bytes == 2 * 4  # AdamW keeps `step` as a float32 scalar tensor per parameter


# --------------------------------------------------------------------------- telemetry

IDS = telemetry.DeviceIds(uuid="8a2f0c4e-1111-2222-3333-444455556666", bdf="0000:3b:00.0")


def fake_nvml(power_mw=250_000, init_error=None, uuid_error=None, missing=(), energy_mj=None):
    log = []

    def init():
        if init_error:
            raise init_error
        log.append("init")

    def by_uuid(uuid):
        if uuid_error:
            raise uuid_error
        log.append(("uuid", uuid))
        return f"h-{uuid}"

    def by_pci(bdf):
        log.append(("pci", bdf))
        return f"h-{bdf}"

    lib = SimpleNamespace(
        NVML_CLOCK_GRAPHICS=0,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetHandleByPciBusId_v2=by_pci,
        nvmlDeviceGetPowerUsage=lambda h: power_mw() if callable(power_mw) else power_mw,
        nvmlDeviceGetClockInfo=lambda h, kind: 1980 if kind == 0 else -1,
        nvmlDeviceGetTemperature=lambda h, kind: 61 if kind == 0 else -1,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=97, memory=40),
        nvmlDeviceGetTotalEnergyConsumption=lambda h: energy_mj() if callable(energy_mj) else energy_mj,
        nvmlShutdown=lambda: log.append("shutdown"),
        log=log,
    )
    for name in missing:
        delattr(lib, name)
    return lib


def test_nvml_constant_power_energy_from_samples_where_there_is_no_counter():
    lib = fake_nvml(missing=("nvmlDeviceGetTotalEnergyConsumption",))
    with TelemetrySampler(CUDA0, interval_s=0.01, library=lib, ids=IDS) as s:
        time.sleep(0.15)
    t = s.result(steps=10, samples_per_step=32)
    assert t.available and t.reason is None
    assert t.n_samples == len(s.samples) >= 2
    assert (t.mean_power_w, t.max_power_w, t.mean_clock_mhz, t.max_temp_c, t.mean_util_pct) == (250, 250, 1980, 61, 97)
    assert s.duration_s == pytest.approx(s.samples[-1][0] - s.samples[0][0])
    assert s.duration_s > 0
    assert t.energy_j == pytest.approx(250 * s.duration_s, rel=0.05) and t.energy_source == "sampled power"
    assert t.energy_per_step_j == pytest.approx(t.energy_j / 10)
    assert t.samples_per_joule == pytest.approx(10 * 32 / t.energy_j)
    assert lib.log == ["init", ("uuid", "GPU-" + IDS.uuid)]  # found by UUID, never by index
    assert t.device == "GPU-" + IDS.uuid
    assert not any(th.name == "kdbench-telemetry" for th in threading.enumerate())


def test_the_device_is_matched_by_uuid_then_pci_address_never_by_index():
    lib = fake_nvml(uuid_error=RuntimeError("NVML_ERROR_NOT_FOUND"))
    with TelemetrySampler(Backend("cuda", torch.device("cuda", 0)), interval_s=3600, library=lib, ids=IDS) as s:
        pass
    assert lib.log == ["init", ("pci", "0000:3b:00.0")] and s.result(1, 1).device == "0000:3b:00.0"
    current().telemetry_readers.clear()  # a fresh worker: the reader opens again
    lost = fake_nvml(uuid_error=RuntimeError("NVML_ERROR_NOT_FOUND"))
    with TelemetrySampler(CUDA0, library=lost, ids=telemetry.DeviceIds(uuid="x", bdf=None)) as s:
        pass
    t = s.result(1, 1)
    assert t.available is False and "no NVML device has torch's UUID x" in t.reason and _all_numbers_none(t)


def test_energy_is_the_counter_difference_at_the_window_edges(monkeypatch):
    counter = iter([1_000.0, 601_000.0])  # mJ at the window's start and end: 600 J
    lib = fake_nvml(energy_mj=lambda: next(counter))
    with TelemetrySampler(CUDA0, interval_s=0.01, library=lib, ids=IDS) as s:
        start, end = s.on_window
        start()
        time.sleep(0.05)
        end()
    t = s.result(steps=20, samples_per_step=64)
    assert t.energy_source == "counter" and t.energy_j == pytest.approx(600.0)
    assert t.energy_per_step_j == pytest.approx(30.0) and t.samples_per_joule == pytest.approx(20 * 64 / 600)
    assert 0.04 < t.window_s < 5 and "under 5 s" in t.note  # short: flagged
    cols = telemetry.telemetry_columns(t)
    assert cols["energy_source"] == "counter" and cols["energy_window_s"] == t.window_s


def test_the_timed_loop_reads_the_counter_after_the_synchronisations():
    from kdbench.measure.timing import timed_loop

    log = []

    class Clock:
        name = "fake"

        def stamp(self):
            return 0

        def elapsed_ms(self, a, b):
            return 1.0

        def sync(self):
            log.append("sync")

    timed_loop(
        lambda: log.append("call"),
        Clock(),
        warmup=1,
        min_iters=2,
        min_time_s=0,
        max_iters=2,
        on_window=(lambda: log.append("start"), lambda: log.append("end")),
    )
    assert log == ["sync", "call", "sync", "call", "sync", "start", "call", "call", "sync", "end"]


def test_energy_from_samples_is_the_trapezoid_over_entry_and_exit_samples(monkeypatch):
    clock = iter([10.0, 12.0])  # entry sample at t=10 s, exit sample at t=12 s
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    power = iter([100_000, 300_000])  # 100 W, then 300 W
    lib = fake_nvml(power_mw=lambda: next(power))
    with TelemetrySampler(Backend("cuda", torch.device("cuda", 3)), interval_s=3600, library=lib, ids=IDS) as s:
        pass
    t = s.result(steps=4, samples_per_step=8)
    assert t.n_samples == 2 and s.duration_s == 2.0
    assert t.energy_j == 400.0 and t.energy_source == "sampled power"  # (100 + 300) / 2 W * 2 s
    assert t.mean_power_w == 200.0 and t.max_power_w == 300.0
    assert t.energy_per_step_j == 100.0
    assert t.samples_per_joule == 32 / 400


def test_nvml_missing_metric_is_none_not_invented():
    lib = fake_nvml(missing=("nvmlDeviceGetTemperature",))
    with TelemetrySampler(CUDA0, interval_s=3600, library=lib, ids=IDS) as s:
        pass
    t = s.result(1, 1)
    assert t.available and t.max_temp_c is None
    assert t.mean_power_w == 250 and t.mean_clock_mhz == 1980


def fake_amdsmi(log, bdfs=("0000:c1:00.0", "0000:3b:00.0"), power=(250, 400)):
    def temp(h, sensor, metric):
        if sensor == "hotspot":
            raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED")
        assert metric == "current"
        return 55

    return SimpleNamespace(
        AmdSmiClkType=SimpleNamespace(GFX="gfx", MEM="mem"),
        AmdSmiTemperatureType=SimpleNamespace(EDGE="edge", HOTSPOT="hotspot"),
        AmdSmiTemperatureMetric=SimpleNamespace(CURRENT="current"),
        amdsmi_init=lambda: log.append("init"),
        amdsmi_get_processor_handles=lambda: [0, 1],  # amdsmi's order, not HIP's
        amdsmi_get_gpu_device_bdf=lambda h: bdfs[h].upper(),
        amdsmi_get_gpu_device_uuid=lambda h: f"uuid-{h}",
        # MI200-style: current_socket_power unsupported ("N/A"), the average is reported
        amdsmi_get_power_info=lambda h: {
            "current_socket_power": "N/A",
            "average_socket_power": power[h],
            "power_limit": 500,
        },
        amdsmi_get_clock_info=lambda h, kind: {"clk": 2100 if kind == "gfx" else 1300, "min_clk": 500},
        amdsmi_get_temp_metric=temp,
        amdsmi_get_gpu_activity=lambda h: {"gfx_activity": 88, "umc_activity": 20, "mm_activity": "N/A"},
        amdsmi_get_energy_count=lambda h: {"energy_accumulator": 2_000_000, "counter_resolution": 15.3},
        amdsmi_shut_down=lambda: log.append("shutdown"),
    )


def test_amdsmi_reads_the_gpu_torch_uses_found_by_pci_address():
    log = []
    # torch's device is PCI 0000:3b:00.0, amdsmi's second processor
    with TelemetrySampler(ROCM0, interval_s=0.01, library=fake_amdsmi(log), ids=IDS) as s:
        time.sleep(0.1)
    t = s.result(steps=5, samples_per_step=16)
    assert t.available and t.n_samples >= 2 and t.device == "0000:3B:00.0"
    assert (t.mean_power_w, t.mean_clock_mhz, t.max_temp_c, t.mean_util_pct) == (400, 2100, 55, 88)
    assert t.energy_j == pytest.approx(400 * s.duration_s, rel=0.05)  # no window marked: the samples
    assert log == ["init"]  # amdsmi stays initialised for the process: its shut-down is process-wide


def test_amdsmi_on_a_partitioned_mi300x_finds_torchs_partition_by_uuid():
    # G12: the partitions of a CPX-mode MI300X are functions .0-.3 of one PCI slot, and torch reports no
    # function: the address alone matched partition .0 whatever partition torch ran on
    log = []
    bdfs = tuple(f"0000:3b:00.{i}" for i in range(4))
    lib = fake_amdsmi(log, bdfs=bdfs, power=(100, 200, 300, 400))
    lib.amdsmi_get_processor_handles = lambda: [0, 1, 2, 3]
    ids = telemetry.DeviceIds(uuid="uuid-2", bdf="0000:3b:00.0")
    with TelemetrySampler(ROCM0, interval_s=0.01, library=lib, ids=ids) as s:
        time.sleep(0.05)
    t = s.result(1, 1)
    assert t.device == "0000:3B:00.2" and t.mean_power_w == 300
    unknown = telemetry.DeviceIds(uuid="not-there", bdf="0000:3b:00.0")
    with TelemetrySampler(ROCM0, interval_s=0.01, library=lib, ids=unknown) as s:
        pass
    t = s.result(1, 1)
    assert not t.available and "4 amdsmi devices share torch's PCI slot" in t.reason
    assert "cannot tell which partition" in t.reason


def test_amdsmi_energy_counter_in_microjoule_counts():
    log = []
    counts = iter([1_000_000, 1_500_000])
    lib = fake_amdsmi(log)
    lib.amdsmi_get_energy_count = lambda h: {"energy_accumulator": next(counts), "counter_resolution": 15.3}
    with TelemetrySampler(ROCM0, interval_s=3600, library=lib, ids=IDS) as s:
        start, end = s.on_window
        start()
        end()
    assert s.result(10, 1).energy_j == pytest.approx(500_000 * 15.3e-6)


def test_amdsmi_old_clock_key():
    log = []
    lib = fake_amdsmi(log)
    lib.amdsmi_get_clock_info = lambda h, kind: {"cur_clk": 1700, "max_clk": 2100}
    with TelemetrySampler(ROCM0, interval_s=3600, library=lib, ids=IDS) as s:
        pass
    assert s.result(1, 1).mean_clock_mhz == 1700


def _all_numbers_none(t):
    return all(
        v is None
        for v in (
            t.mean_power_w,
            t.max_power_w,
            t.mean_clock_mhz,
            t.max_temp_c,
            t.mean_util_pct,
            t.energy_j,
            t.energy_per_step_j,
            t.samples_per_joule,
        )
    )


def test_cpu_backend_has_no_telemetry(cpu):
    with TelemetrySampler(cpu, library=fake_nvml()) as s:
        pass
    t = s.result(steps=3, samples_per_step=4)
    assert t.available is False and t.n_samples == 0
    assert t.reason == "no GPU telemetry on the cpu backend"
    assert _all_numbers_none(t)


def test_init_failure_is_reported_not_raised():
    lib = fake_nvml(init_error=RuntimeError("NVML Shared Library Not Found"))
    with TelemetrySampler(CUDA0, library=lib, ids=IDS) as s:
        pass
    t = s.result(1, 1)
    assert t.available is False
    assert t.reason == "pynvml initialisation failed: NVML Shared Library Not Found"
    assert _all_numbers_none(t)


@pytest.mark.parametrize("error", [ImportError("no module"), KeyError("libamd_smi.so"), OSError("bad ELF")])
def test_a_library_that_does_not_import_is_reported(monkeypatch, error):
    # amdsmi without its shared library raises KeyError or OSError at import, not ImportError
    def broken(name, *args, **kwargs):
        raise error

    monkeypatch.setattr(telemetry.importlib, "import_module", broken)
    with TelemetrySampler(ROCM0, ids=IDS) as s:
        pass
    t = s.result(1, 1)
    assert t.available is False and t.reason.startswith("amdsmi is not importable")
    assert _all_numbers_none(t)


# --------------------------------------------------------------------------- ceilings


def test_measure_ceilings_on_cpu(cpu):
    rows = measure_ceilings(cpu, dtypes=("fp32", "bf16"), matmul_n=128, copy_bytes=MiB, min_time_s=0.01)
    assert [(r["kind"], r["dtype"], r["size"], r["unit"]) for r in rows] == [
        ("matmul", "fp32", 128, "TFLOP/s"),
        ("matmul", "bf16", 128, "TFLOP/s"),
        ("copy", "uint8", MiB, "GB/s"),
    ]
    for r in rows:
        assert r["error"] is None
        assert math.isfinite(r["value"]) and r["value"] > 0
        assert r["median_ms"] > 0
    for r in rows[:2]:
        assert 0 < r["p05_ms"] <= r["median_ms"]
        assert r["value"] == pytest.approx(2 * 128**3 / (r["p05_ms"] / 1e3) / 1e12)
    assert rows[2]["value"] == pytest.approx(2 * MiB / (rows[2]["p05_ms"] / 1e3) / 1e9)


class ConstantClock:
    """Every timed iteration lasts exactly 4 ms."""

    name = "const"

    def stamp(self):
        return 0

    def elapsed_ms(self, a, b):
        return 4.0

    def sync(self):
        pass


def test_ceiling_arithmetic_on_a_fixed_clock():
    backend = SimpleNamespace(
        name="cpu", device=torch.device("cpu"), device_type="cpu", clock=ConstantClock, synchronize=lambda: None
    )
    rows = measure_ceilings(backend, dtypes=("fp32",), matmul_n=64, copy_bytes=1000, min_time_s=0)
    assert rows[0]["median_ms"] == 4.0 and rows[0]["value"] == pytest.approx(2 * 64**3 / 0.004 / 1e12)
    assert rows[1]["median_ms"] == 4.0 and rows[1]["value"] == pytest.approx(2 * 1000 / 0.004 / 1e9)


class FakeTime:
    """A simulated clock, read by ``timer`` (seconds) and by ``clock()`` (a timing Clock of it, each of
    whose stamps takes a microsecond: a byte copy, which the fakes leave real, takes that long)."""

    name = "fake"
    host = True

    def __init__(self):
        self.now = 0.0

    def timer(self):
        return self.now

    def clock(self):
        return self

    def stamp(self):
        self.now += 1e-6
        return self.now

    def elapsed_ms(self, a, b):
        return (b - a) * 1e3

    def sync(self):
        pass


def test_a_dtype_the_device_emulates_slowly_is_probed_at_a_smaller_size(monkeypatch):
    # simulated matmuls: fp16 takes n^3 x 2.4e-9 s (0.04 s at 256, 0.32 s at 512, 2.6 s at 1024: over the
    # 0.5 s budget), fp32 a hundredth of that; no real fp16 (or fp32) matmul runs, whatever the CPU
    fake = FakeTime()
    calls = []

    def mm(a, b):
        n = a.shape[0]
        calls.append((a.dtype, n))
        fake.now += n**3 * (2.4e-9 if a.dtype == torch.float16 else 2.4e-11)
        return torch.zeros(n, b.shape[1], dtype=a.dtype)

    monkeypatch.setattr(torch, "mm", mm)
    backend = SimpleNamespace(
        name="cpu", device=torch.device("cpu"), device_type="cpu", clock=fake.clock, synchronize=lambda: None
    )
    rows = measure_ceilings(
        backend, dtypes=("fp32", "fp16"), matmul_n=1024, copy_bytes=4096, min_time_s=0, max_call_s=0.5, timer=fake.timer
    )
    assert [(r["dtype"], r["size"]) for r in rows[:2]] == [("fp32", 1024), ("fp16", 512)]
    assert {n for dtype, n in calls if dtype == torch.float16} == {256, 512}  # never a 1024 fp16 call
    assert rows[1]["p05_ms"] == pytest.approx(512**3 * 2.4e-9 * 1e3, rel=1e-3)
    assert rows[1]["value"] == pytest.approx(2 * 512**3 / (rows[1]["p05_ms"] / 1e3) / 1e12)
    assert rows[0]["value"] == pytest.approx(2 / 2.4e-11 / 1e12, rel=1e-3)  # 2n^3 FLOPs in n^3 x 2.4e-11 s


def test_unsupported_dtype_gives_an_error_row(cpu, monkeypatch):
    real_mm = torch.mm

    def mm(a, b):
        if a.dtype == torch.float16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'\nmore detail")
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", mm)
    rows = measure_ceilings(cpu, dtypes=("fp16", "fp32"), matmul_n=32, copy_bytes=4096, min_time_s=0)
    assert rows[0]["value"] is None and rows[0]["median_ms"] is None
    assert rows[0]["error"] == "\"addmm_impl_cpu_\" not implemented for 'Half'"
    assert rows[1]["error"] is None and rows[1]["value"] > 0
    with pytest.raises(KdbenchError, match="unknown dtype"):
        measure_ceilings(cpu, dtypes=("fp8",))


def test_a_copy_the_device_cannot_hold_is_an_error_row_not_the_end_of_the_probe(cpu, monkeypatch):
    real_ones = torch.ones

    def ones(n, **kw):
        if kw.get("dtype") is torch.uint8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB\ndetails")
        return real_ones(n, **kw)

    monkeypatch.setattr(torch, "ones", ones)
    rows = measure_ceilings(cpu, dtypes=("fp32",), matmul_n=32, copy_bytes=4096, min_time_s=0)
    assert rows[0]["error"] is None and rows[0]["value"] > 0  # the matmul row is kept
    assert rows[1]["kind"] == "copy" and rows[1]["value"] is None
    assert rows[1]["error"] == "CUDA out of memory. Tried to allocate 1.00 GiB"


@pytest.mark.parametrize("device_type, expected", [("cuda", 2.0), ("cpu", 0.5)])
def test_probe_runs_long_enough_for_sustained_clocks_on_gpus(monkeypatch, device_type, expected):
    from kdbench.measure import probe as probe_module

    seen = []
    monkeypatch.setattr(probe_module, "times_ms", lambda fn, backend, min_time_s: seen.append(min_time_s) or (1, 1))
    backend = SimpleNamespace(
        name="x", device=torch.device("cpu"), device_type=device_type, clock=ConstantClock, synchronize=lambda: None
    )
    measure_ceilings(backend, dtypes=("fp32",), matmul_n=32, copy_bytes=64)
    assert seen == [expected, expected]
    measure_ceilings(backend, dtypes=("fp32",), matmul_n=32, copy_bytes=64, min_time_s=0.1)
    assert seen[2:] == [0.1, 0.1]


def _rows(fp32, bf16=None, copy=100.0):
    rows = [
        {
            "kind": "matmul",
            "dtype": "fp32",
            "size": 64,
            "value": fp32,
            "unit": "TFLOP/s",
            "median_ms": 1.0,
            "error": None,
        },
        {
            "kind": "matmul",
            "dtype": "bf16",
            "size": 64,
            "value": bf16,
            "unit": "TFLOP/s",
            "median_ms": None,
            "error": None if bf16 is not None else "not supported",
        },
        {
            "kind": "copy",
            "dtype": "uint8",
            "size": 1024,
            "value": copy,
            "unit": "GB/s",
            "median_ms": 0.5,
            "error": None,
        },
    ]
    return rows


def _at(monkeypatch, when):
    class FixedDatetime(datetime):
        @classmethod
        def now(cls, tz=None):
            return when

    monkeypatch.setattr(probes, "datetime", FixedDatetime)


def test_write_probe_file(tmp_path, monkeypatch):
    _at(monkeypatch, datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC))
    env = {"device_name": "GPU-A", "backend": "cuda", "device_count": 2, "hip_version": None}
    path = write_probe(_rows(10.0, 50.0), env, tmp_path / "probes")
    assert re.fullmatch(r"probe-20260304-050607-[0-9a-f]{6}\.parquet", path.name)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    table = pq.read_table(path)
    assert table.column_names == [
        "probe_id",
        "timestamp",
        "kind",
        "dtype",
        "size",
        "value",
        "unit",
        "median_ms",
        "p05_ms",
        "error",
        "device_name",
        "backend",
        "device_count",
        "hip_version",
    ]
    rows = table.to_pylist()
    assert {r["probe_id"] for r in rows} == {path.stem}
    assert rows[0]["timestamp"] == datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    assert [r["value"] for r in rows] == [10.0, 50.0, 100.0]
    assert rows[2]["device_count"] == 2 and rows[2]["hip_version"] is None
    with pytest.raises(ValueError, match="clash"):
        write_probe(_rows(1.0), {"kind": "x"}, tmp_path)


def test_latest_ceiling_picks_newest_matching_probe(tmp_path, monkeypatch):
    env_a = {"device_name": "GPU-A", "backend": "cuda"}
    _at(monkeypatch, datetime(2026, 1, 2, tzinfo=UTC))
    newer = write_probe(_rows(20.0, None, copy=300.0), env_a, tmp_path)  # bf16 failed in this probe
    _at(monkeypatch, datetime(2026, 1, 1, tzinfo=UTC))
    write_probe(_rows(10.0, 40.0), env_a, tmp_path)
    _at(monkeypatch, datetime(2026, 1, 3, tzinfo=UTC))
    write_probe(_rows(99.0, 99.0), {"device_name": "GPU-B", "backend": "cuda"}, tmp_path)
    (tmp_path / "probe-garbage.parquet").write_bytes(b"not parquet")

    assert latest_ceiling(tmp_path, "GPU-A", "cuda") == {"probe_id": newer.stem, "matmul_fp32": 20.0, "copy": 300.0}
    assert latest_ceiling(tmp_path, "GPU-B", "cuda")["matmul_bf16"] == 99.0
    assert latest_ceiling(tmp_path, "GPU-A", "rocm") is None
    assert latest_ceiling(tmp_path, "GPU-C", "cuda") is None


def test_the_probes_class_rows_reach_the_ceiling_under_their_own_keys(tmp_path):
    rows = [
        {"kind": "copy", "dtype": "uint8", "size": 8, "value": 30.0, "unit": "GB/s"},
        {"kind": "exp", "dtype": "fp32", "size": 8, "value": 2.0, "unit": "Gelem/s"},
        {"kind": "conv_grouped", "dtype": "bf16", "size": 8, "value": 0.05, "unit": "TFLOP/s"},
        {"kind": "launch", "dtype": "conv_backward", "size": 1, "value": 12.0, "unit": "us"},
        {"kind": "attention", "dtype": "fp16", "size": 8, "value": None, "unit": "TFLOP/s", "error": "no"},
    ]
    path = write_probe(rows, {"device_name": "CPU-A", "backend": "cpu"}, tmp_path)
    assert latest_ceiling(tmp_path, "CPU-A", "cpu") == {
        "probe_id": path.stem, "copy": 30.0, "exp_fp32": 2.0, "conv_grouped_bf16": 0.05, "launch_conv_backward": 12.0,
    }  # fmt: skip


def test_the_class_rates_are_their_work_over_the_fast_time(cpu):
    from kdbench.measure.flops import count_flops
    from kdbench.measure.probe_classes import measure_classes

    rows = measure_classes(cpu, dtypes=("fp32", "tf32"), elements=1024, times=lambda fn: (fn(), 5.0, 4.0)[1:])
    got = {(r["kind"], r["dtype"]): r for r in rows}
    assert list(got) == [
        ("exp", "fp32"),
        ("elementwise", "fp32"),
        ("attention", "fp32"),
        ("conv", "fp32"),
        ("conv_grouped", "fp32"),
        ("conv_backward", "fp32"),
        ("conv_grouped_backward", "fp32"),
        ("launch", "op"),
        ("launch", "conv"),
        ("launch", "conv_backward"),
    ]  # fmt: skip  (tf32 is the matmul's mode: no class of its own)
    assert got["exp", "fp32"]["value"] == pytest.approx(1024 / 0.004 / 1e9)
    assert got["elementwise", "fp32"]["value"] == pytest.approx(3 * 1024 * 4 / 0.004 / 1e9)
    conv = count_flops(
        lambda: torch.nn.functional.conv2d(torch.ones(32, 64, 16, 16), torch.ones(64, 64, 3, 3), padding=1)
    )
    assert got["conv", "fp32"]["value"] == pytest.approx(conv / 0.004 / 1e12)
    assert got["conv_grouped", "fp32"]["value"] == pytest.approx(conv * 96 * 96 / 64 / 64 / 96 / 0.004 / 1e12)
    # the backwards: the input's and the weight's gradients, twice the forward's FLOPs (grouped ones too)
    assert got["conv_backward", "fp32"]["value"] == pytest.approx(2 * conv / 0.004 / 1e12)
    assert got["conv_grouped_backward", "fp32"]["value"] == pytest.approx(2 * conv * 96 / 64 / 64 / 0.004 / 1e12)
    assert all(r["unit"] == "us" and r["value"] == 4000.0 for k, r in got.items() if k[0] == "launch")
    assert all(r["error"] is None and r["median_ms"] == 5.0 for r in rows)


def test_latest_ceiling_without_probes(tmp_path):
    assert latest_ceiling(tmp_path / "missing", "GPU-A", "cuda") is None
    assert latest_ceiling(tmp_path, "GPU-A", "cuda") is None
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert latest_ceiling(not_a_dir, "GPU-A", "cuda") is None


def test_probe_env_adds_backend(cpu, monkeypatch):
    monkeypatch.setattr(probe, "capture", lambda b: {"device_name": "Some CPU", "device_count": 0})
    assert probe_env(cpu) == {"device_name": "Some CPU", "device_count": 0, "backend": "cpu"}


def test_a_partitioned_mi300x_gets_its_share_of_the_peak():
    # CPX mode: each of 8 partitions shows 38 of the 304 CUs under the full card's name
    assert datasheet_peak("AMD Instinct MI300X", "bf16", units=38) == (
        "MI300X (38 of 304 CUs)",
        pytest.approx(1307.4 / 8),
    )
    assert datasheet_peak("AMD Instinct MI300X", "bf16", units=152)[1] == pytest.approx(1307.4 / 2)  # DPX
    assert datasheet_peak("AMD Instinct MI300X", "bf16", units=304) == ("MI300X", pytest.approx(1307.4))
    assert datasheet_peak("NVIDIA H200", "fp32", units=132) == ("H200 SXM", pytest.approx(67.0))


def test_an_empty_rocm_name_is_named_by_its_architecture():
    assert datasheet_peak("", "bf16", units=304, arch="gfx942:sramecc+:xnack-") == ("MI300X", pytest.approx(1307.4))
    assert datasheet_peak("AMD Radeon Graphics", "fp32", units=110, arch="gfx90a")[0] == "MI250X (per GCD)"
    assert datasheet_peak("AMD Radeon Graphics", "fp32", units=104, arch="gfx90a")[0] == "MI210"
    assert datasheet_peak("AMD Radeon Graphics", "fp32", units=60, arch="gfx1100") is None


def test_amdsmi_power_from_the_metrics_table_where_the_power_cap_is_missing():
    log = []
    lib = fake_amdsmi(log)

    def no_cap(h):
        raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED: power cap")

    lib.amdsmi_get_power_info = no_cap
    lib.amdsmi_get_gpu_metrics_info = lambda h: {"current_socket_power": 321, "temperature_hotspot": 70}
    with TelemetrySampler(ROCM0, interval_s=3600, library=lib, ids=IDS) as s:
        pass
    assert s.result(1, 1).mean_power_w == 321


def test_a_frozen_worker_still_collects_what_measurements_leave():
    # In a fresh process (freezing is for the life of a process): the imports are hidden from the
    # collector, and a reference cycle made afterwards is still collected.
    import subprocess
    import sys

    code = """
import gc, weakref
from kdbench.measure.memory import freeze_imports
freeze_imports()
frozen = gc.get_freeze_count()
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
alive = weakref.ref(a)
del a, b
gc.collect()
print(frozen, alive() is None, len(gc.get_objects()) < frozen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 100_000 and out[1:] == ["True", "True"]
