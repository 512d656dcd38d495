"""Where a cell runs: cpu, cuda or rocm; and the choices that follow from it.

ROCm builds of PyTorch have no ``torch.backends.roc``: they are recognised by
``torch.version.hip`` and use the ``cuda`` device type (HIP is exposed through the
CUDA API), so one code path serves both GPUs.  Autocast and GradScaler use the
device-generic ``torch.amp`` API.  Every choice here reads torch at call time, so
unit tests can simulate a ROCm, CUDA or CPU-only build by monkeypatching torch.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from kdbench.core.errors import KdbenchError
from kdbench.hw.clock import Clock, EventClock, HostClock

# The tensors' dtype of each precision; tf32 keeps fp32 tensors and turns the TF32 math mode on.
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Detected:
    """What this torch build and machine offer."""

    build: str  # "rocm", "cuda" or "cpu": what torch was built for
    gpu_count: int  # usable GPUs (0 when none, or a GPU build on a machine without one)

    @property
    def best(self) -> str:
        return self.build if self.gpu_count > 0 else "cpu"

    def describe(self) -> str:
        if self.gpu_count:
            return f"{self.build} with {self.gpu_count} GPU{'s' if self.gpu_count > 1 else ''}"
        gpu = f" (a {self.build} build of torch, but no usable GPU)" if self.build != "cpu" else ""
        return f"cpu only{gpu}"


def detect() -> Detected:
    if getattr(torch.version, "hip", None):
        build = "rocm"
    elif getattr(torch.version, "cuda", None):
        build = "cuda"
    else:
        build = "cpu"
    count = torch.cuda.device_count() if build != "cpu" and torch.cuda.is_available() else 0
    return Detected(build=build, gpu_count=count)


@dataclass(frozen=True)
class Backend:
    """The resolved backend: its name and the one torch.device that flows through the code."""

    name: str  # "cpu", "cuda" or "rocm"
    device: torch.device

    @property
    def device_type(self) -> str:
        """The torch device type: 'cuda' for both CUDA and ROCm."""
        return self.device.type

    def clock(self) -> Clock:
        """Device events on GPUs (asynchronous work), the host's perf_counter_ns on the CPU."""
        return EventClock(self.device) if self.device_type == "cuda" else HostClock()

    def synchronize(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)


def dist_backend_for(backend_name: str) -> str:
    """The torch.distributed backend: gloo on the CPU; nccl on GPUs (RCCL on ROCm, under the same name)."""
    return "gloo" if backend_name == "cpu" else "nccl"


def device_of(backend_name: str, local_rank: int = 0) -> torch.device:
    """The device a (rank of a) run on ``backend_name`` uses: the CPU, or the GPU of its local rank among
    the GPUs it sees; a rank bound to one GPU of its own (Slurm's --gpus-per-task, a per-task
    CUDA_/HIP_VISIBLE_DEVICES) sees only that one, as cuda:0."""
    if backend_name == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if count == 1:
        return torch.device("cuda", 0)
    raise KdbenchError(
        f"local rank {local_rank} sees {count} GPUs: give each rank one GPU of its own, or every rank all of "
        "the node's GPUs (then local rank i takes GPU i)"
    )


@contextlib.contextmanager
def thread_count(threads: int | None):
    """torch's intra-op thread count set to ``threads`` (None: left as it is) inside the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def resolve(requested: str, detected: Detected | None = None) -> Backend:
    """Turn `auto|cpu|cuda|rocm` into a Backend, or explain in one line why it can't run here."""
    d = detected or detect()
    name = d.best if requested == "auto" else requested
    if name not in ("cpu", "cuda", "rocm"):
        raise KdbenchError(f"unknown backend '{requested}'; use auto, cpu, cuda or rocm")
    if name != "cpu" and d.best != name:
        raise KdbenchError(
            f"backend '{name}' is not available on this machine ({d.describe()}); "
            "run with --device cpu (or --device auto) to measure on what is here"
        )
    device = torch.device("cpu") if name == "cpu" else torch.device("cuda", torch.cuda.current_device())
    return Backend(name=name, device=device)


# --------------------------------------------------------------------------- precision


# --- the fp32 math mode -------------------------------------------------------------------
#
# "fp32" is IEEE fp32 on every vendor: cuDNN's TF32 switch is on by default on NVIDIA (so fp32
# convolutions would run on TF32 tensor cores there) while TF32 is opt-in on ROCm.  kdbench sets
# the switches for every measurement instead of inheriting them: IEEE for every precision but
# tf32, TF32 for tf32.
#
# torch >= 2.9 has per-operator levels (`fp32_precision`) beside the legacy switches (`allow_tf32`,
# `float32_matmul_precision`), and its legacy getters raise when the two views disagree ("PyTorch is
# checking whether allow_tf32 is enabled for cuDNN without a specific operator name ...").  Inductor
# reads the legacy getters (its conv templates, its cache keys, max-autotune's algorithm selection),
# and its forward conv templates read cuDNN's "all" level.  So kdbench sets both views: the legacy
# switches first (on torch >= 2.9 they also set the per-operator levels; `float32_matmul_precision`
# also oneDNN's matmul level, which a user's "medium" leaves at bf16), then every per-operator level
# and cuDNN's "all" level.  The global `torch.backends.fp32_precision` is left alone: it also governs
# oneDNN on the CPU.  Which API exists is read at call time (:func:`new_fp32_api`).


def new_fp32_api() -> bool:
    """Whether this torch has the per-operator ``fp32_precision`` levels (torch >= 2.9)."""
    return hasattr(torch.backends, "fp32_precision")


def _fp32_levels() -> list[Any]:
    """The objects whose ``fp32_precision`` kdbench sets: cuBLAS matmuls, cuDNN's "all", conv and rnn levels."""
    cudnn = torch.backends.cudnn
    return [torch.backends.cuda.matmul, cudnn, cudnn.conv, cudnn.rnn]


def set_math_mode(tf32: bool) -> None:
    """TF32 (True) or IEEE fp32 (False) for fp32 matmuls and cuDNN/MIOpen convolutions, in both APIs."""
    torch.set_float32_matmul_precision("high" if tf32 else "highest")  # every backend's matmuls: oneDNN's too
    torch.backends.cudnn.allow_tf32 = tf32
    if new_fp32_api():
        mode = "tf32" if tf32 else "ieee"
        for level in _fp32_levels():
            level.fp32_precision = mode


def math_flags() -> dict[str, Any]:
    """The effective math switches, as result columns: fp32's (TF32) and the 16-bit GEMMs' reduced-precision
    reductions (cuBLAS's; a bf16 cell's error depends on them, GPU review 4, M10)."""
    return {**_fp32_flags(), **reduced_reduction_flags()}


def reduced_reduction_flags() -> dict[str, bool | None]:
    """Whether bf16 and fp16 GEMMs may reduce in reduced precision (None where this torch lacks the switch)."""
    matmul = torch.backends.cuda.matmul
    flags = {}
    for dtype in ("bf16", "fp16"):
        value = getattr(matmul, f"allow_{dtype}_reduced_precision_reduction", None)
        flags[f"{dtype}_reduced_reduction"] = None if value is None else bool(value)
    return flags


def _fp32_flags() -> dict[str, Any]:
    if new_fp32_api():
        matmul = torch.backends.cuda.matmul.fp32_precision
        if matmul == "none":  # inherits the legacy setting
            matmul = _legacy(torch.get_float32_matmul_precision) or "none"
        return {
            "tf32_matmul": matmul in ("tf32", "high", "medium"),
            "tf32_cudnn": torch.backends.cudnn.conv.fp32_precision == "tf32",
            "float32_matmul_precision": matmul,
        }
    return {
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _legacy(getter: Any) -> Any:
    """A legacy switch's value, or None where torch refuses to read it (the two views disagree)."""
    try:
        return getter()
    except RuntimeError:
        return None


@contextlib.contextmanager
def math_mode(tf32: bool):
    """The block runs in the given fp32 math mode (both APIs consistent); the switches are restored after it."""
    matmul = _legacy(torch.get_float32_matmul_precision)
    cudnn = _legacy(lambda: torch.backends.cudnn.allow_tf32)
    levels = _fp32_levels() if new_fp32_api() else []
    before = [level.fp32_precision for level in levels]
    set_math_mode(tf32)
    try:
        yield
    finally:
        if matmul is not None:  # the legacy switches first: on torch >= 2.9 they set the levels too
            torch.set_float32_matmul_precision(matmul)
        if cudnn is not None:
            torch.backends.cudnn.allow_tf32 = cudnn
        for level, value in zip(levels, before):
            level.fp32_precision = value


def tf32_problem(backend: Backend) -> str:
    """'' when ``backend`` can run TF32, else why not (then a tf32 cell is skipped with the reason)."""
    if backend.device_type != "cuda":
        return "tf32 is a GPU math mode (TF32 tensor cores); the CPU has none"
    props = torch.cuda.get_device_properties(backend.device)
    if backend.name == "rocm":
        arch = (getattr(props, "gcnArchName", "") or "").split(":")[0]
        if not arch.startswith(("gfx94", "gfx95")):
            return f"tf32 (XF32) needs an MI300-class GPU (gfx942/gfx950); this one is {arch or 'unknown'}"
        if os.environ.get("HIPBLASLT_ALLOW_TF32") != "1":
            return "tf32 on ROCm needs HIPBLASLT_ALLOW_TF32=1 in the environment (torch then runs GEMMs in XF32)"
        return ""
    if props.major < 8:
        return f"tf32 needs an NVIDIA Ampere or newer GPU (compute capability 8.0), not {props.major}.{props.minor}"
    return ""


@dataclass(frozen=True)
class AutocastChoice:
    """How a precision is realised on a backend: autocast to a 16-bit dtype, or fp32 in a math mode."""

    precision: str
    applied: bool  # autocast is on (False for fp32 and tf32, and where the dtype is unsupported)
    dtype: torch.dtype | None
    note: str = ""  # why autocast was not applied, when precision asked for it
    tf32: bool = False  # fp32 work (all of it for tf32; what autocast leaves in fp32 otherwise) in TF32
    skip: str = ""  # this backend cannot run the precision at all: the cell is skipped, saying why

    def context(self, device_type: str) -> AbstractContextManager:
        if not self.applied:
            return contextlib.nullcontext()
        return torch.amp.autocast(device_type=device_type, dtype=self.dtype)


def _autocast_works(device_type: str, dtype: torch.dtype) -> str:
    """'' if autocast(device_type, dtype) really enables, else the reason torch gives."""
    if not torch.amp.is_autocast_available(device_type):
        return f"autocast is not available for device type {device_type}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.amp.autocast(device_type=device_type, dtype=dtype):
                enabled = torch.is_autocast_enabled(device_type)
        except (RuntimeError, TypeError) as exc:
            return str(exc).splitlines()[0]
    if not enabled:
        reason = next((str(w.message) for w in caught), "autocast disabled itself")
        return reason.splitlines()[0]
    return ""


def choose_autocast(backend: Backend, precision: str) -> AutocastChoice:
    """fp32 runs plainly (IEEE); tf32 runs fp32 tensors in the TF32 math mode where the GPU has it (and
    is skipped elsewhere); fp16/bf16 run under torch.amp.autocast where the backend supports them."""
    if precision == "fp32":
        return AutocastChoice(precision, applied=False, dtype=None)
    if precision == "tf32":
        problem = tf32_problem(backend)
        note = "XF32 for GEMMs; MIOpen convolutions stay IEEE fp32 on torch releases without TF32 convolutions"
        return AutocastChoice(precision, False, None, note if backend.name == "rocm" else "", not problem, problem)
    dtype = DTYPES[precision]
    # bf16 in hardware: not the emulation torch.cuda.is_bf16_supported() also accepts (T4, V100)
    if backend.device_type == "cuda" and precision == "bf16" and not _bf16_in_hardware():
        return AutocastChoice(precision, False, dtype, "this GPU has no bf16 arithmetic; ran in fp32")
    problem = _autocast_works(backend.device_type, dtype)
    if problem:
        return AutocastChoice(precision, False, dtype, f"{problem}; ran in fp32")
    return AutocastChoice(precision, True, dtype)


def _bf16_in_hardware() -> bool:
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.4 has no emulation to exclude
        return torch.cuda.is_bf16_supported()


def needs_grad_scaler(choice: AutocastChoice) -> bool:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    return choice.applied and choice.dtype == torch.float16


def grad_scaler(backend: Backend, choice: AutocastChoice) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(backend.device_type) if needs_grad_scaler(choice) else None
