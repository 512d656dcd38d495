"""Tests of kdbench.measure.runtimes: how a model is served for inference, on the CPU for real and, for the
GPU-only paths (graph capture, providers), by simulating torch.cuda and ONNX Runtime."""

from __future__ import annotations

import contextlib
import importlib.machinery
import re
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

from kdbench.core.install import extra_hint
from kdbench.data.synthetic import synthetic_batch
from kdbench.hw.backends import Backend
from kdbench.measure import runtimes
from kdbench.measure.onnx import ort_providers
from kdbench.measure.runtimes import OutputCheck, compare_outputs, serve
from kdbench.measure.serving import LeverSkip
from kdbench.models import build_model
from tests.support.helpers import make_config, simulated_gpu

FAKE_CUDA = simulated_gpu("cuda")
FAKE_ROCM = simulated_gpu("rocm")
CPU = Backend("cpu", torch.device("cpu"))


def setup(model_name: str = "resnet8", batch: int = 4, **overrides):
    config = make_config(**overrides)
    torch.manual_seed(0)
    model = build_model(model_name, config.data.num_classes, tuple(config.data.shape))
    x, _ = synthetic_batch(config, batch, torch.device("cpu"), config.seed + 1)
    return model, x, config


def eager_logits(model, x):
    with torch.inference_mode():
        return model.eval()(x)


# --------------------------------------------------------------------------- eager


def test_eager_is_todays_forward(cpu):
    model, x, config = setup()
    served = serve(model, x, "eager", config, cpu)
    assert (served.runtime, served.one_off_ms, served.one_off_kind, served.check) == ("eager", None, None, None)
    assert served.notes == [] and served.graph_breaks is None and served.compiled_graphs is None
    out = served.forward()
    assert out.is_inference() and torch.equal(out, eager_logits(model, x))


def test_unknown_runtime(cpu):
    model, x, config = setup("linear")
    with pytest.raises(ValueError, match="unknown runtime 'tensorrt'"):
        serve(model, x, "tensorrt", config, cpu)


# --------------------------------------------------------------------------- onnxruntime


def test_onnxruntime_on_cpu(cpu):
    model, x, config = setup()
    served = serve(model, x, "onnxruntime", config, cpu)
    assert served.runtime == "onnxruntime" and served.one_off_kind == "ONNX export + session"
    assert served.one_off_ms > 0
    check = served.check
    assert check.ok and check.max_abs_diff < 1e-4 and check.top1_agreement == 1.0
    assert check.tolerance == pytest.approx(1e-3 * float(eager_logits(model, x).abs().max()))
    assert check.text().startswith("ok: max |Δ| ") and "top-1 agreement 100 %" in check.text()
    out = served.forward()
    assert isinstance(out, np.ndarray) and out.shape == (4, 10) and out.dtype == np.float32
    np.testing.assert_allclose(out, eager_logits(model, x).numpy(), atol=1e-4)
    assert any("dynamo exporter, opset 18" in n for n in served.notes)
    assert any(f"CPUExecutionProvider, {torch.get_num_threads()} threads" in n for n in served.notes)


def test_onnx_export_falls_back_to_torchscript(cpu, monkeypatch):
    real = torch.onnx.export
    calls = []

    def export(*args, dynamo=True, **kwargs):
        calls.append(dynamo)
        if dynamo:
            raise RuntimeError("dynamo exporter broke\nsecond line")
        return real(*args, dynamo=False, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", export)
    model, x, config = setup("linear")
    served = serve(model, x, "onnxruntime", config, cpu)
    assert calls == [True, False]
    assert served.check.ok and served.check.top1_agreement == 1.0
    note = next(n for n in served.notes if n.startswith("ONNX:"))
    assert "dynamo exporter failed (RuntimeError: dynamo exporter broke)" in note and "TorchScript" in note


def test_onnx_export_failing_both_ways_is_a_failure(cpu, monkeypatch):
    def export(*args, dynamo=True, **kwargs):
        raise RuntimeError(f"no ({'dynamo' if dynamo else 'torchscript'})")

    monkeypatch.setattr(torch.onnx, "export", export)
    model, x, config = setup("linear")
    with pytest.raises(RuntimeError, match="both exporters") as info:
        serve(model, x, "onnxruntime", config, cpu)
    assert not isinstance(info.value, LeverSkip)


def test_dry_run_says_which_cells_lose_their_onnxruntime_rows(monkeypatch, tmp_path, capsys):
    from kdbench.cli import main
    from tests.support.helpers import write_suite
    from tests.support.suites import tiny_suite

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not installed: find_spec finds nothing
    ort = tiny_suite(
        name="ort", defaults={"data": {"shape": [1, 8, 8]}}, matrix={"inference.runtime": ["eager", "onnxruntime"]}
    )
    suite = write_suite(tmp_path / "ort.yaml", **ort)
    assert main(["run", str(suite), "--dry-run"]) == 0
    assert (
        "skipped here: cell 2's student_inference rows (inference.runtime onnxruntime): onnxruntime: ONNX Runtime is "
        f"not installed; {extra_hint('onnx')}"
    ) in capsys.readouterr().err.splitlines()


def test_onnxruntime_not_installed(cpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    model, x, config = setup("linear")
    with pytest.raises(LeverSkip, match="not installed.*" + re.escape(extra_hint("onnx"))):
        serve(model, x, "onnxruntime", config, cpu)


def ort_module(monkeypatch, **attributes) -> types.ModuleType:
    """A stand-in onnxruntime module in sys.modules (with a spec: torch._dynamo looks modules up)."""
    module = types.ModuleType("onnxruntime")
    module.__spec__ = importlib.machinery.ModuleSpec("onnxruntime", None)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, "onnxruntime", module)
    return module


def fake_onnxruntime(monkeypatch, providers):
    module = ort_module(monkeypatch)
    module.get_available_providers = lambda: list(providers)
    module.InferenceSession = lambda *a, **k: pytest.fail("no session without a provider")


@pytest.mark.parametrize(
    "backend, install", [(FAKE_CUDA, "pip install onnxruntime-gpu"), (FAKE_ROCM, "onnxruntime-migraphx")]
)
def test_onnxruntime_without_the_gpu_provider(monkeypatch, backend, install):
    fake_onnxruntime(monkeypatch, ["AzureExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: pytest.fail("no export without a provider"))
    model, x, config = setup("linear")
    with pytest.raises(LeverSkip, match=install) as info:
        serve(model, x, "onnxruntime", config, backend)
    assert "it has AzureExecutionProvider, CPUExecutionProvider" in str(info.value)


def test_onnxruntime_on_cuda_by_simulation(monkeypatch):
    """CUDAExecutionProvider on torch's stream, IEEE fp32, input and output bound to (here host) memory."""
    import ctypes

    import onnxruntime as ort

    made = {}

    class Binding:
        def __init__(self):
            self.inputs, self.outputs = [], []

        def bind_input(self, *args):
            self.inputs.append(args)

        def bind_output(self, *args):
            self.outputs.append(args)

    class Session:  # a real CPU session under the CUDA provider's name
        def __init__(self, path, sess_options=None, providers=None):
            made["providers"] = providers
            self.real = ort.InferenceSession(path, sess_options, providers=["CPUExecutionProvider"])
            self.binding = Binding()
            made["session"] = self

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

        def get_inputs(self):
            return self.real.get_inputs()

        def get_outputs(self):
            return self.real.get_outputs()

        def io_binding(self):
            return self.binding

        def run_with_iobinding(self, binding):
            made["runs"] = made.get("runs", 0) + 1
            name, _, _, _, shape, pointer = binding.inputs[0]
            x = np.ctypeslib.as_array((ctypes.c_float * int(np.prod(shape))).from_address(pointer)).reshape(shape)
            result = self.real.run(None, {name: x})[0]
            _, _, _, _, shape, pointer = binding.outputs[0]
            ctypes.memmove(pointer, result.ctypes.data, result.nbytes)

    ort_module(
        monkeypatch,
        __version__="sim",
        get_available_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
        SessionOptions=ort.SessionOptions,
        InferenceSession=Session,
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    order = []

    class FakeStream:
        def __init__(self, cuda_stream, name):
            self.cuda_stream, self.name = cuda_stream, name

        def wait_stream(self, other):
            order.append(f"{self.name} waits for {other.name}")

    default = FakeStream(0, "torch's")  # torch's default stream: ORT reads 0 as "no user stream" (G6)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(5678, "ORT's"))

    model, x, config = setup("linear")
    served = serve(model, x, "onnxruntime", config, FAKE_CUDA)
    assert made["providers"] == [
        ("CUDAExecutionProvider", {"device_id": "0", "user_compute_stream": "5678", "use_tf32": "0"})
    ]
    assert served.synchronous and served.own_memory and not served.compiled
    order.clear()
    served.forward()
    assert order == ["ORT's waits for torch's", "torch's waits for ORT's"]  # the clock's events bracket ORT's work
    binding = made["session"].binding
    input_name = made["session"].get_inputs()[0].name
    assert [b[:5] for b in binding.inputs] == [(input_name, "cuda", 0, np.float32, [4, 3, 16, 16])]
    assert binding.inputs[0][5] == x.data_ptr()  # the batch itself, no copy
    assert [b[:5] for b in binding.outputs] == [(made["session"].get_outputs()[0].name, "cuda", 0, np.float32, [4, 10])]
    assert served.check.ok and served.check.top1_agreement == 1.0
    assert "onnxruntime sim: CUDAExecutionProvider" in served.notes
    runs = made["runs"]
    out = served.forward()
    assert made["runs"] == runs + 1 and isinstance(out, torch.Tensor) and out.data_ptr() == binding.outputs[0][5]
    torch.testing.assert_close(out, eager_logits(model, x), rtol=1e-4, atol=1e-5)


def test_gpu_providers_get_torchs_device_id(monkeypatch):
    from kdbench.hw.backends import choose_autocast
    from kdbench.measure.onnx import _provider_options

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # G6: MIGraphX got no device id
    choice = choose_autocast(FAKE_ROCM, "fp32")
    for provider in ("MIGraphXExecutionProvider", "ROCMExecutionProvider"):
        assert _provider_options(provider, FAKE_ROCM, choice) == {"device_id": "3"}
    assert _provider_options("CPUExecutionProvider", FAKE_ROCM, choice) == {}


def test_onnxruntime_rows_on_a_gpu_are_never_launch_bound_and_leave_memory_empty():
    from kdbench.measure.runtimes import Served
    from kdbench.workloads.vision import outside_torch

    served = Served(lambda: None, "onnxruntime", 1.0, "ONNX export + session", None, synchronous=True, own_memory=True)
    profile = {
        "peak_memory_bytes": 10,
        "peak_reserved_bytes": 20,
        "memory_growth_bytes": 0,
        "memory_footprint_bytes": 5,
    }
    judge_launch, notes = outside_torch(served, profile, FAKE_CUDA)
    assert judge_launch is False and set(profile.values()) == {None}
    assert "block the host until the device is done" in notes[0] and "its own arena" in notes[1]
    eager = Served(lambda: None, "eager", None, None, None)
    assert outside_torch(eager, {}, FAKE_CUDA) == (True, [])
    assert outside_torch(served, {}, CPU) == (True, [])  # the CPU: RSS sees ORT's memory


def test_onnxruntime_provider_that_does_not_start(monkeypatch):
    import onnxruntime as ort

    class Session:
        def __init__(self, path, sess_options=None, providers=None):
            pass

        def get_providers(self):
            return ["CPUExecutionProvider"]  # what ONNX Runtime does when CUDA's libraries are missing

    ort_module(
        monkeypatch,
        get_available_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
        SessionOptions=ort.SessionOptions,
        InferenceSession=Session,
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: types.SimpleNamespace(cuda_stream=1))
    model, x, config = setup("linear")
    with pytest.raises(LeverSkip, match="CUDAExecutionProvider is in this ONNX Runtime but did not start"):
        serve(model, x, "onnxruntime", config, FAKE_CUDA)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_onnxruntime_skips_16_bit_cells(cpu, precision):
    model, x, config = setup("linear", precision=precision)
    with pytest.raises(LeverSkip, match="exported in fp32; bf16/fp16 cells are not served"):
        serve(model, x, "onnxruntime", config, cpu)


@pytest.mark.parametrize(
    "backend, available, chosen",
    [
        ("cpu", ["CPUExecutionProvider"], "CPUExecutionProvider"),
        ("cpu", ["CUDAExecutionProvider", "CPUExecutionProvider"], "CPUExecutionProvider"),
        (
            "cuda",
            ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
            "CUDAExecutionProvider",
        ),
        ("rocm", ["ROCMExecutionProvider", "CPUExecutionProvider"], "ROCMExecutionProvider"),
        ("rocm", ["MIGraphXExecutionProvider", "CPUExecutionProvider"], "MIGraphXExecutionProvider"),
        (
            "rocm",
            ["ROCMExecutionProvider", "MIGraphXExecutionProvider", "CPUExecutionProvider"],
            "MIGraphXExecutionProvider",
        ),
    ],
)
def test_provider_choice(backend, available, chosen):
    assert ort_providers(backend, available) == [chosen]


@pytest.mark.parametrize(
    "backend, available, install",
    [
        ("cpu", [], "[onnx]'"),  # the extra, installed as kdbench was (kdbench.core.install.extra_hint)
        ("cuda", ["CPUExecutionProvider"], "onnxruntime-gpu"),
        ("rocm", ["CPUExecutionProvider", "CUDAExecutionProvider"], "onnxruntime-migraphx (or onnxruntime-rocm)"),
    ],
)
def test_provider_missing(backend, available, install):
    with pytest.raises(LeverSkip, match=r"^onnxruntime: no ") as info:
        ort_providers(backend, available)
    assert install in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- int8


def test_int8_of_linear_layers(cpu):
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10))
    _, x, config = setup("linear", batch=8)
    served = serve(model, x, "int8", config, cpu)
    assert served.runtime == "int8" and served.one_off_kind == "int8 quantization" and served.one_off_ms > 0
    assert served.notes == ["int8: dynamic quantization of 2 Linear layers"]
    check = served.check
    assert check.tolerance == pytest.approx(0.1 * float(eager_logits(model, x).abs().max()))
    assert check.ok and 0.0 <= check.top1_agreement <= 1.0 and check.max_abs_diff > 0  # int8 is not exact
    assert served.forward().shape == (8, 10)
    assert isinstance(model[1], nn.Linear)  # the cell's model is left as it was


def test_int8_keeps_convolutions_fp32(cpu):
    model, x, config = setup("resnet8")
    served = serve(model, x, "int8", config, cpu)
    assert served.notes[0] == "int8: dynamic quantization of 1 Linear layer"
    assert "convolutions stay fp32" in served.notes[1] and "calibration" in served.notes[1]
    assert served.check.ok and served.forward().shape == (4, 10)


def test_int8_on_a_gpu_skips():
    model, x, config = setup("linear")
    with pytest.raises(LeverSkip, match="CPU only.*not on cuda"):
        serve(model, x, "int8", config, FAKE_CUDA)


def test_int8_in_a_bf16_cell_skips(cpu):
    model, x, config = setup("linear", precision="bf16")
    with pytest.raises(LeverSkip, match="int8 replaces the cell's precision"):
        serve(model, x, "int8", config, cpu)


# --------------------------------------------------------------------------- compile (the one compile test)


def test_compile_default(cpu):
    model, x, config = setup("linear")
    served = serve(model, x, "compile", config, cpu)
    assert served.runtime == "compile" and served.one_off_kind == "torch.compile (default)"
    assert served.one_off_ms > 0
    assert isinstance(served.graph_breaks, int) and served.graph_breaks == 0
    assert isinstance(served.compiled_graphs, int) and served.compiled_graphs >= 1
    assert served.check.ok and served.check.top1_agreement == 1.0
    torch.testing.assert_close(served.forward(), eager_logits(model, x), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- graphs


def test_graphs_on_the_cpu_skip(cpu):
    model, x, config = setup("linear")
    with pytest.raises(LeverSkip, match="^graphs: CUDA/HIP graphs need a GPU"):
        serve(model, x, "eager", config, cpu, graphs=True)


@pytest.mark.parametrize("runtime", ["onnxruntime", "int8"])
def test_graphs_replay_only_eager_and_compile(runtime):
    model, x, config = setup("linear")
    with pytest.raises(LeverSkip, match=f"only eager and compile.*not {runtime}"):
        serve(model, x, runtime, config, FAKE_CUDA, graphs=True)


def test_graphs_with_reduce_overhead_skip():
    model, x, config = setup("linear", compile="reduce-overhead")
    with pytest.raises(LeverSkip, match="reduce-overhead already replays CUDA graphs"):
        serve(model, x, "compile", config, FAKE_CUDA, graphs=True)


def test_graphs_with_max_autotune_compile_without_inductors_own_cuda_graphs(monkeypatch):
    # G4: max-autotune turns on inductor's CUDA graphs; captured inside kdbench's graph, the captures nest
    modes = []

    def fake_compile(model, mode=None):
        modes.append(mode)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(runtimes, "_graphed", lambda built, backend, choice: built)  # no capture on the CPU
    model, x, config = setup("linear", compile="max-autotune")
    served = serve(model, x, "compile", config, FAKE_CUDA, graphs=True)
    assert modes == ["max-autotune-no-cudagraphs"]
    assert served.one_off_kind == "torch.compile (max-autotune-no-cudagraphs)" and served.compiled
    assert any("max-autotune's own CUDA graphs cannot be captured" in n for n in served.notes)
    serve(model, x, "compile", config, FAKE_CUDA)  # not graphed: max-autotune as asked
    assert modes[-1] == "max-autotune"


@pytest.fixture
def fake_graphs(monkeypatch):
    """torch.cuda streams and graphs as recorders: ``log`` holds what happened, in order; ``where`` is the
    stream (or capture) the next forward runs on."""
    state = {"log": [], "where": "current"}
    log = state["log"]

    class FakeStream:
        def __init__(self, name, device=None):
            self.name = name
            log.append(("stream", name, device))

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    current = FakeStream("current")

    @contextlib.contextmanager
    def stream(s):
        before, state["where"] = state["where"], s.name
        yield
        state["where"] = before

    class FakeGraph:
        def replay(self):
            log.append(("replay",))

    @contextlib.contextmanager
    def graph(g):
        assert isinstance(g, FakeGraph)
        before, state["where"] = state["where"], "capture"
        log.append(("capture begins",))
        yield
        log.append(("capture ends",))
        state["where"] = before

    log.clear()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("side", device))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return state


class Logged(nn.Module):
    """A model that logs where each of its forwards runs."""

    def __init__(self, model, state):
        super().__init__()
        self.model, self.state = model, state

    def forward(self, x):
        self.state["log"].append(("forward", self.state["where"]))
        return self.model(x)


@pytest.mark.parametrize("backend, kind", [(FAKE_CUDA, "CUDA graph capture"), (FAKE_ROCM, "HIP graph capture")])
def test_graph_capture_by_simulation(fake_graphs, backend, kind):
    inner, x, config = setup("resnet8")
    model = Logged(inner, fake_graphs)
    served = serve(model, x, "eager", config, backend, graphs=True)
    assert served.runtime == "eager + graphs" and served.one_off_kind == kind and served.one_off_ms >= 0
    assert served.check.ok and served.check.max_abs_diff == 0.0 and served.check.top1_agreement == 1.0
    assert fake_graphs["log"] == [
        ("forward", "current"),  # the eager reference, first
        ("stream", "side", backend.device),
        ("wait", "side", "current"),  # the side stream starts after the work queued so far
        *[("forward", "side")] * runtimes.GRAPH_WARMUP,
        ("wait", "current", "side"),  # and the current stream waits for the warm-up
        ("capture begins",),
        ("forward", "capture"),
        ("capture ends",),
        ("replay",),  # the call checked against eager
    ]
    fake_graphs["log"].clear()
    out = served.forward()
    assert fake_graphs["log"] == [("replay",)]  # the served call replays, it does not run the model
    torch.testing.assert_close(out, eager_logits(inner, x), rtol=0, atol=0)


# --------------------------------------------------------------------------- checking


def test_compare_outputs_mismatch():
    ref = torch.tensor([[1.0, 0.0, -2.0], [0.0, 3.0, 1.0]])
    out = ref.clone()
    out[1] = torch.tensor([4.0, 3.0, 1.0])  # argmax flips in the second sample
    check = compare_outputs(out, ref, 1e-3)
    assert check == OutputCheck(max_abs_diff=4.0, top1_agreement=0.5, tolerance=pytest.approx(3e-3), ok=False)
    assert check.text() == "MISMATCH: max |Δ| 4.0e+00 > 3.0e-03, top-1 agreement 50 %"


def test_compare_outputs_of_other_shapes_and_types():
    ref = torch.tensor([[0.5, -1.0]])
    assert compare_outputs(np.array([[0.5, -1.0]], dtype=np.float32), (ref,), 1e-3).ok
    assert compare_outputs({"logits": ref.double()}, ref, 1e-3).ok
    wrong = compare_outputs(torch.zeros(2, 2), ref, 1e-3)
    assert not wrong.ok and wrong.max_abs_diff == float("inf") and wrong.top1_agreement == 0.0


def test_every_timed_row_says_how_autograd_ran(cpu):
    """grad_mode: the step trains (autograd), torch serving runs under inference_mode, onnxruntime outside torch."""
    from kdbench.config.plan import Cell, cell_id_of
    from kdbench.models.cache import ModelCache
    from kdbench.run.cell import measure_cell

    config = make_config(
        pair={"teacher": "linear", "student": "linear"},
        data={"kind": "synthetic", "shape": [1, 4, 4], "num_classes": 4},
        batch_size=4,
        timing={"warmup": 0, "min_iters": 2, "max_iters": 2, "min_time_s": 0.0},
        inference={"batch_sizes": [2], "runtime": "onnxruntime"},
    )
    rows = measure_cell(Cell(0, cell_id_of(config), config), cpu, ModelCache())
    got = {(str(r["measurement"]), r.get("runtime")): r.get("grad_mode") for r in rows if r["status"] == "ok"}
    assert got == {
        ("distill_step", None): "autograd",
        ("student_inference", "onnxruntime"): None,
        ("teacher_inference", "eager"): "inference_mode",
    }
