"""Tests of backend detection, resolution and the precision choices.

Other torch builds (ROCm, CUDA, CPU-only) are simulated by monkeypatching torch,
which kdbench.hw.backends reads at call time; nothing here touches a real GPU.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from kdbench.core.errors import KdbenchError
from kdbench.hw import backends
from kdbench.hw.backends import (
    AutocastChoice,
    Backend,
    Detected,
    choose_autocast,
    detect,
    grad_scaler,
    needs_grad_scaler,
    resolve,
)
from kdbench.hw.clock import EventClock, HostClock


def _simulate(monkeypatch, *, hip, cuda, available, count):
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def rocm2(monkeypatch):
    _simulate(monkeypatch, hip="6.2.41133", cuda=None, available=True, count=2)


@pytest.fixture
def cuda1(monkeypatch):
    _simulate(monkeypatch, hip=None, cuda="12.4", available=True, count=1)


@pytest.fixture
def cpu_only(monkeypatch):
    _simulate(monkeypatch, hip=None, cuda=None, available=False, count=0)


@pytest.fixture
def cuda_build_no_gpu(monkeypatch):
    # device_count would say 1 (e.g. a driver that enumerates but can't initialise):
    # without is_available() there is no usable GPU, so it must not be counted.
    _simulate(monkeypatch, hip=None, cuda="12.8", available=False, count=1)


def _assert_one_line_error(excinfo, *fragments):
    msg = str(excinfo.value)
    assert msg
    assert "\n" not in msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return msg


# --------------------------------------------------------------------------- ROCm


def test_rocm_detect(rocm2):
    d = detect()
    assert d == Detected(build="rocm", gpu_count=2)
    assert d.build == "rocm"
    assert d.gpu_count == 2
    assert d.best == "rocm"
    assert d.describe() == "rocm with 2 GPUs"


@pytest.mark.parametrize("requested", ["auto", "rocm"])
def test_rocm_resolve_uses_cuda_device_type(rocm2, requested):
    b = resolve(requested)
    assert b.name == "rocm"
    assert b.device == torch.device("cuda", 0)
    assert b.device.type == "cuda"
    assert b.device_type == "cuda"
    clock = b.clock()
    assert isinstance(clock, EventClock)
    assert clock.device == torch.device("cuda", 0)
    assert clock.name == "device_event"


def test_rocm_resolve_uses_current_device(rocm2, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve("rocm").device == torch.device("cuda", 1)


def test_rocm_build_rejects_cuda(rocm2):
    with pytest.raises(KdbenchError) as excinfo:
        resolve("cuda")
    msg = _assert_one_line_error(excinfo, "--device cpu", "'cuda'", "rocm with 2 GPUs")
    assert excinfo.value.exit_code == 2
    assert msg.startswith("backend 'cuda' is not available on this machine")


def test_rocm_build_cpu_still_works(rocm2):
    b = resolve("cpu")
    assert b == Backend(name="cpu", device=torch.device("cpu"))
    assert b.device_type == "cpu"
    assert isinstance(b.clock(), HostClock)
    assert b.clock().name == "perf_counter_ns"


def test_rocm_backend_synchronize_calls_torch(rocm2, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    resolve("rocm").synchronize()
    resolve("cpu").synchronize()  # a no-op on the CPU
    assert calls == [torch.device("cuda", 0)]


# --------------------------------------------------------------------------- CUDA


def test_cuda_detect_and_resolve(cuda1):
    d = detect()
    assert d == Detected(build="cuda", gpu_count=1)
    assert d.best == "cuda"
    assert d.describe() == "cuda with 1 GPU"
    auto = resolve("auto")
    assert auto.name == "cuda"
    assert auto.device == torch.device("cuda", 0)
    assert resolve("cuda") == auto
    assert isinstance(auto.clock(), EventClock)
    assert resolve("cpu").name == "cpu"


def test_cuda_build_rejects_rocm(cuda1):
    with pytest.raises(KdbenchError) as excinfo:
        resolve("rocm")
    _assert_one_line_error(excinfo, "'rocm'", "--device cpu", "cuda with 1 GPU")


# --------------------------------------------------------------------------- CPU only


def test_cpu_only_build(cpu_only):
    d = detect()
    assert d == Detected(build="cpu", gpu_count=0)
    assert d.best == "cpu"
    assert d.describe() == "cpu only"
    b = resolve("auto")
    assert b.name == "cpu"
    assert b.device == torch.device("cpu")
    assert isinstance(b.clock(), HostClock)


@pytest.mark.parametrize("requested", ["cuda", "rocm"])
def test_cpu_only_build_rejects_gpus(cpu_only, requested):
    with pytest.raises(KdbenchError) as excinfo:
        resolve(requested)
    _assert_one_line_error(excinfo, f"'{requested}'", "--device cpu", "cpu only")


def test_cuda_build_without_gpu(cuda_build_no_gpu):
    d = detect()
    assert d.build == "cuda"
    assert d.gpu_count == 0
    assert d.best == "cpu"
    desc = d.describe()
    assert desc == "cpu only (a cuda build of torch, but no usable GPU)"
    assert "no usable GPU" in desc
    assert resolve("auto") == Backend(name="cpu", device=torch.device("cpu"))
    with pytest.raises(KdbenchError) as excinfo:
        resolve("cuda")
    _assert_one_line_error(excinfo, "no usable GPU", "--device cpu")


def test_resolve_uses_given_detected_without_probing(monkeypatch):
    def boom():
        raise AssertionError("detect() must not run when `detected` is given")

    monkeypatch.setattr(backends, "detect", boom)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve("auto", Detected("rocm", 4)).name == "rocm"
    assert resolve("auto", Detected("rocm", 0)).name == "cpu"
    with pytest.raises(KdbenchError):
        resolve("cuda", Detected("rocm", 4))


@pytest.mark.parametrize("requested", ["tpu", "mps", "", "CUDA", "gpu"])
def test_unknown_backend(cpu_only, requested):
    with pytest.raises(KdbenchError) as excinfo:
        resolve(requested)
    _assert_one_line_error(excinfo, f"unknown backend '{requested}'", "auto, cpu, cuda or rocm")


# --------------------------------------------------------------------------- autocast

CPU = Backend(name="cpu", device=torch.device("cpu"))
FAKE_GPU = Backend(name="cuda", device=torch.device("cuda", 0))


def _linear_out_dtype(choice: AutocastChoice) -> torch.dtype:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad(), choice.context("cpu"):
        return model(torch.randn(3, 8)).dtype


def test_fp32_is_plain():
    choice = choose_autocast(CPU, "fp32")
    assert choice == AutocastChoice("fp32", applied=False, dtype=None, note="")
    assert isinstance(choice.context("cpu"), contextlib.nullcontext)
    assert _linear_out_dtype(choice) == torch.float32
    assert not needs_grad_scaler(choice)
    assert grad_scaler(CPU, choice) is None


def test_bf16_on_cpu():
    choice = choose_autocast(CPU, "bf16")
    assert choice.applied is True
    assert choice.dtype == torch.bfloat16
    assert choice.note == ""
    assert _linear_out_dtype(choice) == torch.bfloat16
    # each call gives a fresh, working context
    for _ in range(2):
        with choice.context("cpu"):
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_fp16_on_cpu():
    # This torch (2.14) supports float16 autocast on the CPU.
    choice = choose_autocast(CPU, "fp16")
    assert choice.applied is True
    assert choice.dtype == torch.float16
    assert choice.note == ""
    assert _linear_out_dtype(choice) == torch.float16


def test_bf16_on_gpu_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    choice = choose_autocast(FAKE_GPU, "bf16")
    assert choice.applied is False
    assert choice.dtype == torch.bfloat16
    assert "bf16" in choice.note
    assert "fp32" in choice.note
    assert isinstance(choice.context("cuda"), contextlib.nullcontext)
    assert not needs_grad_scaler(choice)


@pytest.mark.parametrize("backend", [CPU, FAKE_GPU], ids=["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_autocast_unavailable_for_device_type(monkeypatch, backend, precision):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    seen = []

    def unavailable(device_type):
        seen.append(device_type)
        return False

    monkeypatch.setattr(torch.amp, "is_autocast_available", unavailable)
    choice = choose_autocast(backend, precision)
    assert seen == [backend.device_type]
    assert choice.applied is False
    assert choice.dtype == backends.DTYPES[precision]
    assert choice.note == f"autocast is not available for device type {backend.device_type}; ran in fp32"
    assert "\n" not in choice.note
    assert not needs_grad_scaler(choice)
    assert grad_scaler(backend, choice) is None


def test_autocast_that_disables_itself(monkeypatch):
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a, **k: False)
    choice = choose_autocast(CPU, "fp16")
    assert choice.applied is False
    # torch warns nothing in this case, so the fallback reason is used
    assert choice.note == "autocast disabled itself; ran in fp32"
    assert isinstance(choice.context("cpu"), contextlib.nullcontext)


def test_autocast_disabled_with_warning_uses_first_warning_line(monkeypatch):
    import warnings

    class WarningAutocast:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            warnings.warn("device cannot autocast to this dtype\nmore detail", stacklevel=2)
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.amp, "autocast", WarningAutocast)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a, **k: False)
    choice = choose_autocast(CPU, "bf16")
    assert choice.applied is False
    assert choice.note == "device cannot autocast to this dtype; ran in fp32"


def test_autocast_that_raises(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("dtype not supported here\nsecond line of detail")

    monkeypatch.setattr(torch.amp, "autocast", broken)
    choice = choose_autocast(CPU, "bf16")
    assert choice.applied is False
    assert choice.note == "dtype not supported here; ran in fp32"


# --------------------------------------------------------------------------- GradScaler


def test_needs_grad_scaler():
    assert needs_grad_scaler(AutocastChoice("fp16", True, torch.float16)) is True
    assert needs_grad_scaler(AutocastChoice("fp16", False, torch.float16, "n/a")) is False
    assert needs_grad_scaler(AutocastChoice("bf16", True, torch.bfloat16)) is False
    assert needs_grad_scaler(AutocastChoice("bf16", False, torch.bfloat16, "n/a")) is False
    assert needs_grad_scaler(AutocastChoice("fp32", False, None)) is False


def test_grad_scaler_on_cpu():
    fp16 = choose_autocast(CPU, "fp16")
    assert needs_grad_scaler(fp16)
    scaler = grad_scaler(CPU, fp16)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled()
    # the scaler actually scales a CPU loss
    loss = torch.tensor(2.0)
    assert scaler.scale(loss).item() == pytest.approx(2.0 * scaler.get_scale())
    assert scaler.get_scale() > 1.0

    bf16 = choose_autocast(CPU, "bf16")
    assert grad_scaler(CPU, bf16) is None
    assert grad_scaler(CPU, AutocastChoice("fp16", False, torch.float16, "off")) is None


# --- fp32 means IEEE fp32; tf32 only when asked (simulated GPUs) ----------------------------------

FAKE_ROCM = Backend("rocm", torch.device("cuda", 0))


def _props(monkeypatch, **props):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(**props))


@pytest.mark.parametrize(
    "backend, props, env, problem",
    [
        (CPU, {}, {}, "the CPU has none"),
        (FAKE_GPU, {"major": 9, "minor": 0}, {}, ""),  # H100/H200
        (FAKE_GPU, {"major": 8, "minor": 0}, {}, ""),  # A100
        (FAKE_GPU, {"major": 7, "minor": 5}, {}, "compute capability 8.0), not 7.5"),  # T4
        (FAKE_ROCM, {"gcnArchName": "gfx942:sramecc+:xnack-"}, {"HIPBLASLT_ALLOW_TF32": "1"}, ""),  # MI300X
        (FAKE_ROCM, {"gcnArchName": "gfx942:sramecc+:xnack-"}, {}, "HIPBLASLT_ALLOW_TF32=1"),
        (FAKE_ROCM, {"gcnArchName": "gfx90a:sramecc+:xnack-"}, {"HIPBLASLT_ALLOW_TF32": "1"}, "this one is gfx90a"),
    ],
)
def test_where_tf32_can_run(monkeypatch, backend, props, env, problem):
    _props(monkeypatch, **props)
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    choice = choose_autocast(backend, "tf32")
    assert choice.applied is False and choice.dtype is None  # fp32 tensors: no autocast
    if problem:
        assert problem in choice.skip and choice.tf32 is False  # the cell is skipped, saying why
    else:
        assert choice.skip == "" and choice.tf32 is True


def test_fp32_and_16_bit_precisions_run_in_ieee_fp32():
    for precision in ("fp32", "bf16", "fp16"):
        choice = choose_autocast(CPU, precision)
        assert choice.tf32 is False and choice.skip == ""


@pytest.fixture
def restore_math_flags():
    before = backends.math_flags()
    yield
    backends.set_math_mode(before["tf32_matmul"])


def test_math_mode_sets_both_switches_and_restores_them(restore_math_flags):
    backends.set_math_mode(False)
    assert backends.math_flags()["tf32_matmul"] is False and backends.math_flags()["tf32_cudnn"] is False
    with backends.math_mode(True):
        flags = backends.math_flags()
        assert flags["tf32_matmul"] is True and flags["tf32_cudnn"] is True
        if backends.new_fp32_api():  # torch >= 2.9: the per-operator levels too, cuDNN's "all" level among them
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
            assert torch.backends.cudnn.conv.fp32_precision == "tf32"
            assert torch.backends.cudnn.fp32_precision == "tf32"
    assert backends.math_flags()["tf32_matmul"] is False and backends.math_flags()["tf32_cudnn"] is False


def _switches() -> dict:
    """Every fp32 switch inductor or a library may read, through both APIs (a getter that raises fails)."""
    read = {
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        "matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision,
    }
    if backends.new_fp32_api():
        read.update(
            {
                "matmul": lambda: torch.backends.cuda.matmul.fp32_precision,
                "cudnn": lambda: torch.backends.cudnn.fp32_precision,
                "conv": lambda: torch.backends.cudnn.conv.fp32_precision,
                "rnn": lambda: torch.backends.cudnn.rnn.fp32_precision,
            }
        )
    return {name: getter() for name, getter in read.items()}


@pytest.mark.parametrize("new_api", [True, False], ids=["fp32_precision", "allow_tf32-only"])
def test_inside_math_mode_every_switch_reads_and_agrees_through_both_apis(monkeypatch, restore_math_flags, new_api):
    # torch >= 2.9 raises on a legacy getter while the per-operator levels disagree with it (G2): inductor's
    # conv templates, its cache keys and max-autotune read those getters.  The allow_tf32-only branch is what
    # torch < 2.9 runs (simulated here by hiding the new API from kdbench).
    if not new_api:
        monkeypatch.setattr(backends, "new_fp32_api", lambda: False)
    for tf32 in (False, True):
        with backends.math_mode(tf32):
            switches = _switches()
            flags = backends.math_flags()
        assert switches["cudnn.allow_tf32"] is tf32 and switches["matmul.allow_tf32"] is tf32
        assert switches["float32_matmul_precision"] == ("high" if tf32 else "highest")
        level = "tf32" if tf32 else "ieee"
        if new_api and "conv" in switches:
            assert {switches[k] for k in ("matmul", "cudnn", "conv", "rnn")} == {level}
        assert flags["tf32_matmul"] is tf32 and flags["tf32_cudnn"] is tf32


def test_math_mode_restores_a_reduced_matmul_precision_and_the_levels(restore_math_flags):
    torch.set_float32_matmul_precision("medium")  # a user's bf16-reduced matmuls: not a plain on/off switch
    try:
        before = _switches()
        with backends.math_mode(False):
            assert _switches()["float32_matmul_precision"] == "highest"
        assert _switches() == before
    finally:
        torch.set_float32_matmul_precision("highest")


def test_cudnn_tf32_default_is_not_what_an_fp32_cell_runs_with(restore_math_flags):
    # torch's default turns cuDNN's TF32 on (so NVIDIA "fp32" convolutions would be TF32); a measurement
    # sets IEEE and records it
    from kdbench.config.plan import Cell
    from kdbench.models import ModelCache
    from kdbench.run.cell import measure_cell
    from tests.support.helpers import make_config

    backends.set_math_mode(True)  # as an inherited default would have it
    config = make_config(
        pair={"teacher": "linear", "student": "linear"},
        data={"shape": [1, 4, 4], "num_classes": 4},
        inference={"batch_sizes": [2]},
    )
    rows = measure_cell(Cell(0, "c", config), CPU, ModelCache())
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert all(r["tf32_matmul"] is False and r["tf32_cudnn"] is False for r in rows)


def test_a_tf32_cell_on_the_cpu_is_skipped_with_the_reason():
    from kdbench.config.plan import Cell
    from kdbench.models import ModelCache
    from kdbench.run.cell import measure_cell
    from tests.support.helpers import make_config

    for field in ("precision", "teacher_precision"):
        config = make_config(
            **{field: "tf32"},
            pair={"teacher": "linear", "student": "linear"},
            data={"shape": [1, 4, 4], "num_classes": 4},
        )
        rows = measure_cell(Cell(0, "c", config), CPU, ModelCache())
        assert [r["status"] for r in rows] == ["skipped"] * 5
        assert all("tf32 is a GPU math mode" in r["error"] for r in rows)


def test_bf16_only_by_emulation_runs_in_fp32_with_a_note(monkeypatch):
    # T4/V100: torch.cuda.is_bf16_supported() is True by emulation unless asked for hardware support
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    choice = choose_autocast(FAKE_GPU, "bf16")
    assert choice.applied is False and "no bf16 arithmetic" in choice.note and "fp32" in choice.note


@pytest.mark.parametrize("count, local_rank, index", [(8, 3, 3), (1, 3, 0), (1, 0, 0), (4, 0, 0)])
def test_a_rank_uses_the_gpu_it_sees(monkeypatch, count, local_rank, index):
    # per-task binding (one visible GPU per rank) shows each rank its GPU as cuda:0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert backends.device_of("cuda", local_rank) == torch.device("cuda", index)


def test_a_rank_that_sees_some_but_not_its_gpu_is_told_what_to_change(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(KdbenchError, match="local rank 3 sees 2 GPUs"):
        backends.device_of("rocm", 3)
    assert backends.device_of("cpu", 5) == torch.device("cpu")


def test_a_rocm_device_is_recorded_by_its_architecture_family_and_compute_units(monkeypatch):
    from kdbench.hw.environment import device_facts

    _props(
        monkeypatch,
        name="AMD Instinct MI300X",
        gcnArchName="gfx942:sramecc+:xnack-",
        multi_processor_count=38,  # a CPX partition
        total_memory=24 << 30,
    )
    facts = device_facts(FAKE_ROCM)
    assert facts["device_arch"] == "gfx942" and facts["device_arch_full"] == "gfx942:sramecc+:xnack-"
    assert facts["device_compute_units"] == 38 and facts["device_memory_bytes"] == 24 << 30
    _props(monkeypatch, name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=141 << 30)
    assert device_facts(FAKE_GPU)["device_arch"] == "sm_90"


@pytest.mark.parametrize(
    "hip, memory_format, env, noted",
    [
        ("6.2.41133", "channels_last", {}, True),
        ("6.2.41133", "channels_last", {"PYTORCH_MIOPEN_SUGGEST_NHWC": "1"}, False),
        ("6.2.41133", "contiguous", {}, False),
        (None, "channels_last", {}, False),  # CUDA: cuDNN takes NHWC as it comes
    ],
)
def test_channels_last_on_rocm_says_whether_miopen_was_asked_for_nhwc(monkeypatch, hip, memory_format, env, noted):
    from kdbench.config.schema import CellConfig
    from kdbench.workloads.vision import layout_note

    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.delenv("PYTORCH_MIOPEN_SUGGEST_NHWC", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = CellConfig(pair={"teacher": "resnet8", "student": "resnet8"}, memory_format=memory_format)
    note = layout_note(config, "cuda")
    assert ("PYTORCH_MIOPEN_SUGGEST_NHWC=1" in note) is noted
    assert layout_note(config, "cpu") == ""


def test_the_16_bit_gemms_reduced_precision_reductions_are_recorded(monkeypatch):
    """GPU review 4, M10: a bf16 cell's GEMMs may reduce in bf16 (torch's default); the row says whether they could."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = False
        flags = backends.math_flags()
        assert flags["bf16_reduced_reduction"] is False
        assert flags["fp16_reduced_reduction"] is bool(matmul.allow_fp16_reduced_precision_reduction)
        matmul.allow_bf16_reduced_precision_reduction = True
        assert backends.math_flags()["bf16_reduced_reduction"] is True
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
    monkeypatch.setattr(backends.torch.backends.cuda, "matmul", types.SimpleNamespace())  # a torch without them
    assert backends.reduced_reduction_flags() == {"bf16_reduced_reduction": None, "fp16_reduced_reduction": None}
