"""The ``onnxruntime`` serving runtime: the student exported to ONNX and served by ONNX Runtime.

The model exported by ``torch.onnx.export`` (the dynamo exporter, opset 18; the
TorchScript exporter when that fails, with a note) at the batch's fixed shape, and
served by an ``onnxruntime.InferenceSession``: CPUExecutionProvider on the CPU (with
torch's intra-op thread count), CUDAExecutionProvider on CUDA (on a dedicated
non-default stream ordered against torch's around each call — ORT takes a user stream
of 0, torch's default stream, for none and would run on its own —, TF32 only for a tf32
cell, input and output bound to device memory with IO binding),
MIGraphXExecutionProvider or ROCMExecutionProvider on ROCm (on torch's device id; numpy
input: the host/device copies are inside the timed call, and a note says so).  ORT's
``Run`` blocks the host until the device is done, so its GPU rows are never flagged
launch-bound, and its device memory comes from its own arena, which torch's statistics
do not see: those rows leave the memory columns empty, and notes say both.  The export is
fp32: a bf16/fp16 cell is skipped rather than served at a precision it did not ask
for.  One-off: export plus session creation (wall clock), plus the first run's excess
over a steady run (where a provider compiles, e.g. MIGraphX).  ONNX Runtime missing,
or without the backend's provider, skips the row, naming what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdbench.core.install import extra_hint
from kdbench.hw.backends import AutocastChoice, Backend
from kdbench.measure.serving import Built, LeverSkip, excess_ms, wall_ms

ONNX_OPSET = 18
# The ONNX Runtime providers of each backend, in order of preference, and what to install for them.
ORT_PROVIDERS = {
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider",),
    "rocm": ("MIGraphXExecutionProvider", "ROCMExecutionProvider"),  # ROCm EP: deprecated by ONNX Runtime
}
ORT_INSTALL = {
    "cpu": "",  # the onnx extra, installed as kdbench was (kdbench.core.install.extra_hint)
    "cuda": "pip install onnxruntime-gpu (in place of onnxruntime)",
    "rocm": "install onnxruntime-migraphx (or onnxruntime-rocm) for this ROCm release, in place of onnxruntime",
}


def ort_providers(backend_name: str, available: list[str] | tuple[str, ...]) -> list[str]:
    """The ONNX Runtime execution provider for ``backend_name`` among ``available``
    (``onnxruntime.get_available_providers()``): CPU, CUDA, or on ROCm MIGraphX, else the ROCm provider.
    LeverSkip, naming what to install, when this ONNX Runtime has none of them."""
    wanted = ORT_PROVIDERS[backend_name]
    for provider in wanted:
        if provider in available:
            return [provider]
    names = " or ".join(wanted)
    have = ", ".join(available) or "none"
    fix = ORT_INSTALL[backend_name] or extra_hint("onnx")
    raise LeverSkip(f"onnxruntime: no {names} in this ONNX Runtime (it has {have}); {fix}")


def onnxruntime_missing() -> str | None:
    """Why ``inference.runtime: onnxruntime`` rows are skipped here for a missing package, with the line that installs
    it (None: ONNX Runtime is installed); found without importing it, for the plan."""
    if importlib.util.find_spec("onnxruntime") is None:
        return f"onnxruntime: ONNX Runtime is not installed; {extra_hint('onnx')}"
    return None


def _import_onnxruntime():
    try:
        return importlib.import_module("onnxruntime")
    except ImportError as exc:
        raise LeverSkip(f"onnxruntime: ONNX Runtime is not installed ({exc}); {extra_hint('onnx')}") from None


def export_onnx(model: nn.Module, x: torch.Tensor, path: Path) -> str:
    """Export ``model`` at ``x``'s fixed shape to ``path`` with the dynamo exporter, or the TorchScript one
    when that fails; the note naming the exporter used.  torch.export reads cuDNN's TF32 switch through the
    legacy API: :func:`kdbench.hw.backends.math_mode` keeps it readable in either mode."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x,), str(path), dynamo=True, opset_version=ONNX_OPSET, verbose=False)
        return f"ONNX: dynamo exporter, opset {ONNX_OPSET}"
    except Exception as exc:
        first = f"{type(exc).__name__}: {_first_line(exc)}"
    path.unlink(missing_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=ONNX_OPSET)
    except Exception as exc:
        raise RuntimeError(f"ONNX export failed with both exporters: dynamo ({first}); torchscript ({exc})") from exc
    return (
        f"ONNX: the dynamo exporter failed ({first[:200]}); exported with the TorchScript exporter, opset {ONNX_OPSET}"
    )


def _first_line(exc: BaseException) -> str:
    """The exception's first line; for torch.onnx's TorchExportError, the summary of the error behind it."""
    cause = exc.__cause__ if exc.__cause__ is not None and "torch.export" in str(exc) else exc
    return next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)


def _provider_options(provider: str, backend: Backend, choice: AutocastChoice, stream: Any = None) -> dict[str, str]:
    """The provider's options: the device torch measures on (every GPU provider), and on CUDA the stream ORT
    runs on (``stream``: a dedicated non-default one, see :func:`_io_bound`) and its TF32 switch."""
    if backend.device_type != "cuda" or provider == "CPUExecutionProvider":
        return {}
    index = backend.device.index if backend.device.index is not None else torch.cuda.current_device()
    options = {"device_id": str(index)}
    if provider == "CUDAExecutionProvider":
        if stream is not None:
            options["user_compute_stream"] = str(stream.cuda_stream)
        options["use_tf32"] = "1" if choice.tf32 else "0"  # ONNX Runtime's default is TF32: IEEE unless tf32
    return options


def build_onnxruntime(model: nn.Module, x: torch.Tensor, choice: AutocastChoice, backend: Backend) -> Built:
    """``model`` exported at ``x``'s shape and served by an ONNX Runtime session on ``backend``'s provider
    (see the module docstring); LeverSkip where that cannot run here."""
    if choice.precision in ("bf16", "fp16"):
        raise LeverSkip(
            "onnxruntime: the student is exported in fp32; bf16/fp16 cells are not served by ONNX Runtime here"
        )
    ort = _import_onnxruntime()
    provider = ort_providers(backend.name, ort.get_available_providers())[0]
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    notes = []
    if backend.device_type == "cpu":
        options.intra_op_num_threads = torch.get_num_threads()
    # ORT reads a user stream of 0 (torch's default stream) as "none" and runs on a stream of its own: a
    # dedicated non-default stream, ordered against torch's around each call (see _io_bound)
    stream = torch.cuda.Stream(backend.device) if provider == "CUDAExecutionProvider" else None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kdbench-onnx-") as folder:
        path = Path(folder) / "model.onnx"
        notes.append(export_onnx(model, x, path))
        session = ort.InferenceSession(
            str(path),
            sess_options=options,
            providers=[(provider, _provider_options(provider, backend, choice, stream))],
        )
    setup_ms = wall_ms(start)
    used = session.get_providers()
    if not used or used[0] != provider:
        raise LeverSkip(
            f"onnxruntime: {provider} is in this ONNX Runtime but did not start (missing GPU libraries?); "
            f"the session fell back to {', '.join(used) or 'nothing'}"
        )
    threads = f", {options.intra_op_num_threads} threads (torch's)" if backend.device_type == "cpu" else ""
    notes.append(f"onnxruntime {ort.__version__}: {provider}{threads}")
    name, out_name = session.get_inputs()[0].name, session.get_outputs()[0].name
    if stream is not None:
        forward = _io_bound(session, name, out_name, x, backend, stream)
    else:
        feed = {name: x.detach().contiguous().cpu().numpy()}

        def forward() -> Any:
            return session.run([out_name], feed)[0]

        if backend.device_type != "cpu":
            notes.append("onnxruntime: numpy input, so the host/device copies of input and output are timed too")
    first_ms, _ = excess_ms(forward, backend, 1)
    return Built(forward, setup_ms + first_ms, "ONNX export + session", notes, synchronous=True, own_memory=True)


def _io_bound(session, name: str, out_name: str, x: torch.Tensor, backend: Backend, stream: Any) -> Callable[[], Any]:
    """``session``'s run with input and output bound to device memory (no host copies in the timed call), on
    ``stream`` (the session's ``user_compute_stream``): it waits for torch's current stream (the input is
    ready), and torch's stream waits for it, so the clock's events on torch's stream bracket ORT's work."""
    import numpy as np

    index = backend.device.index or 0
    x = x.detach().contiguous()
    shape = [int(d) if isinstance(d, int) else -1 for d in session.get_outputs()[0].shape]
    if any(d < 0 for d in shape):  # symbolic dimensions: read the shape from one run
        shape = list(session.run([out_name], {name: x.cpu().numpy()})[0].shape)
    out = torch.empty(shape, dtype=torch.float32, device=backend.device)
    binding = session.io_binding()
    binding.bind_input(name, "cuda", index, np.float32, list(x.shape), x.data_ptr())
    binding.bind_output(out_name, "cuda", index, np.float32, shape, out.data_ptr())

    current = torch.cuda.current_stream(backend.device)

    def forward() -> torch.Tensor:
        stream.wait_stream(current)
        session.run_with_iobinding(binding)
        current.wait_stream(stream)
        return out

    forward.keep = (x, out, binding, stream)  # type: ignore[attr-defined]  # the bound memory lives with the call
    return forward
