"""How a model is served for an inference measurement, what serving it costs once, and whether it still agrees.

:func:`serve` turns a model (on the device, in the cell's memory format) and the fixed
input batch into :class:`Served`: the one call an inference measurement times, the
runtime's one-off cost, and an :class:`OutputCheck` of that call's output against the
eager model's.  The eager reference is computed first, in the cell's precision and fp32
math mode; every other runtime is checked against it before :func:`serve` returns.  A
disagreement beyond the tolerance does not raise: the check is stored with the row
(``ok=False``).  A lever that cannot run here raises
:class:`kdbench.measure.serving.LeverSkip` (the row is stored as skipped, with its
one-line reason); anything else that goes wrong raises an ordinary exception (a failed
row).  ONNX Runtime's part is :mod:`kdbench.measure.onnx`; what the runtimes share
(the built forward, the timing of one-off costs) is :mod:`kdbench.measure.serving`.

Runtimes
--------
``eager``
    Today's forward: ``eval()``, ``torch.inference_mode`` and the cell's autocast.  No
    one-off cost, no check.

``compile``
    ``torch.compile(model, mode=...)`` (mode ``default`` is ``mode=None``), called as eager
    is.  ``torch._dynamo.reset()`` runs first, so another cell's (or the distillation
    step's) compiled graphs do not make the compile look free; it also drops them.
    One-off: the excess of the first three calls over a steady call (the first call
    compiles; with ``reduce-overhead`` the CUDA graph trees record during the next ones),
    each call in host time between synchronizations.  The compiled code and its CUDA graph
    pool are released after the measurement (``torch._dynamo.reset()``), so they do not
    count in the next measurement's memory peaks.  Inductor's on-disk FX graph cache survives the reset:
    when it served graphs the one-off is that of a warm cache, and a note says so.  Graph
    breaks (``torch._dynamo.utils.counters["graph_break"]``) and compiled graphs
    (``counters["stats"]["unique_graphs"]``) are reported.

``onnxruntime``
    The model exported to ONNX and served by an ``onnxruntime.InferenceSession`` on the backend's
    provider (:mod:`kdbench.measure.onnx` says how).  One-off: export plus session creation, plus
    the first run's excess over a steady run.  Missing here, it skips the row, naming what to install.

``int8``
    ``torch.ao.quantization.quantize_dynamic`` of a CPU copy of the model: Linear layers
    get int8 weights, activations are quantized per call.  CPU only (a GPU backend skips:
    these are fbgemm/x86 kernels), and fp32 cells only (int8 replaces the precision; a
    bf16/fp16 cell is skipped rather than measured as something else).  Convolutions stay
    fp32: torch's dynamically quantized Conv2d warns of poor accuracy and is no faster,
    and static int8 convolutions need calibration data, so the note says what was
    quantized.  One-off: the quantization time.  Checked loosely (0.1 relative), with
    the top-1 agreement reported.

Graphs (``graphs=True``)
    The eager or compiled forward, warmed up on a side stream, captured once into a
    ``torch.cuda.CUDAGraph`` (a HIP graph on ROCm) and replayed; the served call replays
    it and returns the captured output tensor.  Autocast's weight-cast cache is off for
    graphed forwards (cached casts would be freed under the graph).  One-off: the capture
    (plus the compile, for compile + graphs).  GPUs only; ONNX Runtime and int8 are not
    replayed, and ``reduce-overhead`` already replays CUDA graphs: these combinations skip.
    ``max-autotune`` turns on inductor's own CUDA graphs, which cannot be captured inside
    kdbench's: a graphed max-autotune forward is compiled ``max-autotune-no-cudagraphs``
    (the one-off kind and a note say so).

Tolerances are relative to the largest eager logit: fp32 1e-3, tf32 1e-2, bf16/fp16 5e-2,
int8 0.1.  Outputs are compared in float32 on the host.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast, math_mode
from kdbench.measure.onnx import build_onnxruntime
from kdbench.measure.serving import Built, LeverSkip, excess_ms, wall_ms

RUNTIMES = ("eager", "compile", "onnxruntime", "int8")
REPLAYABLE = ("eager", "compile")  # the runtimes a CUDA/HIP graph can capture
GRAPH_WARMUP = 3  # forwards on the side stream before the capture
COMPILE_FIRST_CALLS = 3  # calls whose excess over a steady call is the compile's one-off cost

# Relative to max |eager output|: the largest |runtime - eager| that still agrees.
RELATIVE_TOLERANCE = {"fp32": 1e-3, "tf32": 1e-2, "bf16": 5e-2, "fp16": 5e-2}
INT8_TOLERANCE = 0.1


@dataclass(frozen=True)
class OutputCheck:
    """A runtime's output against the eager model's, on the same batch."""

    max_abs_diff: float  # max |runtime output - eager output| over the batch's logits (float32)
    top1_agreement: float  # share of samples whose argmax agrees with eager
    tolerance: float  # the tolerance used: absolute, the relative tolerance times max |eager output|
    ok: bool  # max_abs_diff <= tolerance (top-1 agreement is reported, not required: near-ties may flip)

    def text(self) -> str:
        verdict, sign = ("ok", "≤") if self.ok else ("MISMATCH", ">")
        return (
            f"{verdict}: max |Δ| {self.max_abs_diff:.1e} {sign} {self.tolerance:.1e}, "
            f"top-1 agreement {self.top1_agreement * 100:.3g} %"
        )


@dataclass
class Served:
    """One way of serving a model: the call to time, and what it cost and changed."""

    forward: Callable[[], Any]  # one inference call, to be timed as today's forward is
    runtime: str  # "eager", "compile", "onnxruntime", "int8" (+ " + graphs" when replayed from a graph)
    one_off_ms: float | None  # export + session, quantization, compile, graph capture; None for eager
    one_off_kind: str | None  # e.g. "torch.compile (default)", "ONNX export + session", "CUDA graph capture"
    check: OutputCheck | None  # None for eager
    notes: list[str] = field(default_factory=list)  # caveats: what was quantized, the provider used, ...
    graph_breaks: int | None = None  # compile: torch._dynamo graph breaks during the compile
    compiled_graphs: int | None = None  # compile: graphs dynamo compiled
    compiled: bool = False  # torch.compile built it: its compiled code (and CUDA graph pool) is released after
    synchronous: bool = False  # each call blocks the host until the device is done (ONNX Runtime's Run)
    own_memory: bool = False  # device memory from an allocator torch's statistics do not see (ORT's arena)


# --------------------------------------------------------------------------- checking


def _logits(out: Any) -> torch.Tensor:
    """A model's output as one float32 host tensor: the tensor itself, a tuple's or list's first
    element, a dict's "logits" (else its first value), or a numpy array (ONNX Runtime)."""
    if isinstance(out, (tuple, list)):
        return _logits(out[0])
    if isinstance(out, dict):
        return _logits(out["logits"] if "logits" in out else next(iter(out.values())))
    if not isinstance(out, torch.Tensor):
        out = torch.from_numpy(out)
    return out.detach().to("cpu", torch.float32)


def compare_outputs(out: Any, reference: Any, relative: float) -> OutputCheck:
    """``out`` against the eager ``reference``: agreement within ``relative`` times max |reference|."""
    ref, got = _logits(reference), _logits(out)
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    tolerance = relative * max(scale, 1e-6)
    if ref.shape != got.shape:
        return OutputCheck(float("inf"), 0.0, tolerance, False)
    diff = float((got - ref).abs().max()) if ref.numel() else 0.0
    rows = (ref.shape[0], -1) if ref.dim() >= 2 else (1, -1)
    agree = (ref.reshape(rows).argmax(1) == got.reshape(rows).argmax(1)).float().mean()
    return OutputCheck(diff, float(agree), tolerance, diff <= tolerance)


def relative_tolerance(runtime: str, precision: str) -> float:
    return INT8_TOLERANCE if runtime == "int8" else RELATIVE_TOLERANCE[precision]


# --------------------------------------------------------------------------- forwards and timing


def _autocast(choice: AutocastChoice, device_type: str, graphed: bool) -> contextlib.AbstractContextManager:
    """The precision's autocast; without the weight-cast cache for a graphed forward (the cache is freed
    when autocast exits, under a graph that still reads it)."""
    if graphed and choice.applied:
        return torch.amp.autocast(device_type=device_type, dtype=choice.dtype, cache_enabled=False)
    return choice.context(device_type)


def _forward(
    model: Callable[[torch.Tensor], Any], x: torch.Tensor, choice: AutocastChoice, backend: Backend, graphed=False
) -> Callable[[], Any]:
    """The eager call, as :func:`kdbench.measure.cell.inference_forward` makes it."""

    def forward() -> Any:
        with torch.inference_mode(), _autocast(choice, backend.device_type, graphed):
            return model(x)

    return forward


# --------------------------------------------------------------------------- compile


def _compile(model: nn.Module, x, choice, backend, mode: str, graphed: bool) -> Built:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    notes = []
    built_mode = mode
    if graphed and mode == "max-autotune":  # its own CUDA graphs would be captured inside kdbench's graph
        built_mode = "max-autotune-no-cudagraphs"
        notes.append(
            "graphs: compiled with max-autotune-no-cudagraphs (max-autotune's own CUDA graphs cannot be captured "
            "inside the graph kdbench replays)"
        )
    compiled = torch.compile(model, mode=None if built_mode == "default" else built_mode)
    forward = _forward(compiled, x, choice, backend, graphed)
    one_off, _ = excess_ms(forward, backend, COMPILE_FIRST_CALLS)
    breaks = int(sum(counters["graph_break"].values()))
    graphs = int(counters["stats"]["unique_graphs"])
    if breaks:
        notes.append(f"compile: {breaks} graph break{'s' if breaks > 1 else ''}")
    cached = int(counters["inductor"]["fxgraph_cache_hit"])
    if cached:
        notes.append(
            f"compile: Inductor's on-disk cache served {cached} graph{'s' if cached > 1 else ''}; "
            "the one-off cost is that of a warm cache"
        )
    if mode == "reduce-overhead" and backend.device_type == "cpu":
        notes.append("compile: reduce-overhead's CUDA graphs do nothing on the CPU")
    return Built(forward, one_off, f"torch.compile ({built_mode})", notes, breaks, graphs, compiled=True)


# --------------------------------------------------------------------------- int8


def _int8(model: nn.Module, x: torch.Tensor, choice: AutocastChoice, backend: Backend) -> Built:
    if backend.device_type != "cpu":
        raise LeverSkip(
            f"int8: dynamic int8 quantization runs on the CPU only (fbgemm/x86 kernels), not on {backend.name}"
        )
    if choice.precision != "fp32":
        raise LeverSkip(f"int8: int8 replaces the cell's precision; measure it in an fp32 cell, not {choice.precision}")
    quantize = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize is None:
        raise LeverSkip("int8: this torch has no torch.ao.quantization.quantize_dynamic (removed; see torchao)")
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's and quantized tensors' deprecation warnings
        quantized = quantize(copy.deepcopy(model).cpu(), {nn.Linear}, dtype=torch.qint8)
    one_off = wall_ms(start)
    quantized.eval()
    convs = sum(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    notes = [f"int8: dynamic quantization of {linears} Linear layer{'s' if linears != 1 else ''}"]
    if not linears:
        notes = ["int8: the model has no Linear layers, so nothing was quantized (it runs in fp32)"]
    if convs:
        notes.append(
            "int8: convolutions stay fp32 (dynamic quantization covers Linear layers; static int8 "
            "convolutions need calibration)"
        )
    return Built(_forward(quantized, x, choice, backend), one_off, "int8 quantization", notes)


# --------------------------------------------------------------------------- graphs


def capture_graph(forward: Callable[[], Any], backend: Backend) -> tuple[Callable[[], Any], float]:
    """``forward`` warmed up on a side stream, then captured into a CUDA (HIP) graph; the call that replays
    it and returns the captured output, and the capture time in ms."""
    device = backend.device
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP):
            forward()
    current.wait_stream(side)
    backend.synchronize()
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.cuda.graph(graph):
        out = forward()
    backend.synchronize()
    capture_ms = wall_ms(start)

    def replay() -> Any:
        graph.replay()
        return out

    replay.graph = graph  # type: ignore[attr-defined]
    return replay, capture_ms


def _graph_problem(runtime: str, compile_mode: str, backend: Backend) -> str:
    if runtime not in REPLAYABLE:
        return f"graphs: only eager and compile forwards are replayed from a CUDA/HIP graph, not {runtime}"
    if backend.device_type != "cuda":
        return "graphs: CUDA/HIP graphs need a GPU; this cell runs on the CPU"
    if runtime == "compile" and compile_mode == "reduce-overhead":
        return "graphs: compile mode reduce-overhead already replays CUDA graphs (CUDA graph trees)"
    return ""


# --------------------------------------------------------------------------- serve


def serve(
    model: nn.Module,
    x: torch.Tensor,
    runtime: str,
    config,
    backend: Backend,
    compile_mode: str | None = None,
    graphs: bool = False,
) -> Served:
    """``model`` served by ``runtime`` on the fixed batch ``x`` (see the module docstring): the call to time,
    its one-off cost and its output checked against eager.  ``compile_mode`` defaults to the cell's
    ``compile`` ("default" when that is "off").  Time the call inside ``math_mode(choice.tf32)``."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; one of {', '.join(RUNTIMES)}")
    mode = compile_mode if compile_mode not in (None, "off") else config.compile
    mode = "default" if mode == "off" else mode
    choice = choose_autocast(backend, config.precision)
    if choice.skip:
        raise LeverSkip(choice.skip)
    problem = _graph_problem(runtime, mode, backend) if graphs else ""
    if problem:
        raise LeverSkip(problem)
    model.eval()
    with math_mode(choice.tf32):
        eager = _forward(model, x, choice, backend, graphed=graphs)
        reference = _logits(eager()).clone()  # first, before any runtime is built (a copy: outputs may alias)
        if runtime == "eager":
            built = Built(eager, None, None, [])
        elif runtime == "compile":
            built = _compile(model, x, choice, backend, mode, graphs)
        elif runtime == "onnxruntime":
            built = build_onnxruntime(model, x, choice, backend)
        else:
            built = _int8(model, x, choice, backend)
        name = runtime
        if graphs:
            built = _graphed(built, backend, choice)
            name += " + graphs"
        check = None
        if runtime != "eager" or graphs:
            out = built.forward()
            backend.synchronize()
            check = compare_outputs(out, reference, relative_tolerance(runtime, choice.precision))
    return Served(
        forward=built.forward,
        runtime=name,
        one_off_ms=built.one_off_ms,
        one_off_kind=built.one_off_kind,
        check=check,
        notes=built.notes,
        graph_breaks=built.graph_breaks,
        compiled_graphs=built.compiled_graphs,
        compiled=built.compiled,
        synchronous=built.synchronous,
        own_memory=built.own_memory,
    )


def _graphed(built: Built, backend: Backend, choice: AutocastChoice) -> Built:
    replay, capture_ms = capture_graph(built.forward, backend)
    kind = f"{'HIP' if backend.name == 'rocm' else 'CUDA'} graph capture"
    notes = list(built.notes)
    if choice.applied:
        notes.append("graphs: autocast's weight-cast cache is off, as graph capture needs")
    return Built(
        replay,
        (built.one_off_ms or 0.0) + capture_ms,
        f"{built.one_off_kind} + {kind}" if built.one_off_kind else kind,
        notes,
        built.graph_breaks,
        built.compiled_graphs,
        compiled=built.compiled,
    )
