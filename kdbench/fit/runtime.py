"""What a GPU's runtime holds beside a step's tensors, per rank, each figure with its source: the runtime's context
(outside the caching allocator), the BLAS libraries' workspaces (through the allocator, so inside
``max_memory_allocated``: a term of the prediction) and, in a cell of ``world_size > 1``, NCCL's or RCCL's buffers
(outside the allocator: reported beside the peak, never in it).

**BLAS workspaces** (torch 2.14, ``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``parseChosenWorkspaceSize``,
``parseCUDABlasLtWorkspaceSize``, ``unified_cublas_and_lt_workspaces``, ``setWorkspaceForHandle``,
https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/cuda/CublasHandlePool.cpp).  torch gives each (BLAS handle,
stream) pair a workspace allocated through the caching allocator and kept for the process's life:

* CUDA: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, KiB), by default ``:4096:8`` (32 MiB) on compute
  capability 9.x, 10.x and 12.x, ``:4096:2:16:8`` (8 MiB + 128 KiB) before.  cuBLASLt shares that workspace: unified
  unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` (outside fbcode builds), which gives it one of its own of
  ``CUBLASLT_WORKSPACE_SIZE`` KiB (1,024 by default).
* ROCm: ``CUBLAS_WORKSPACE_CONFIG``, else ``HIPBLAS_WORKSPACE_CONFIG``, else ``ROCBLAS_WORKSPACE_CONFIG``, by default
  128 MiB on gfx94x/gfx95x and 32 MiB before; hipBLASLt has a workspace of its own (ROCm's handles do not share):
  ``CUBLASLT_WORKSPACE_SIZE``, else ``HIPBLASLT_WORKSPACE_SIZE`` KiB, 76 MiB by default.

Handles are per thread (a thread-local pool window), so a training step holds :data:`WORKSPACE_PAIRS` of them: the
forward's (the calling thread's) and the backward's (autograd's device thread's), on the one stream.  That count is
read from the code, not measured: the device check's ``max_memory_allocated`` before and after a first step settles
it.  The variables are read from this process's environment, which is the run's when the fit runs where the cells
will.

**Context.**  A CUDA 12 context with lazy module loading, measured after one tensor: 274 MiB
(pytorch/pytorch#86509, 287,047,680 bytes; 636 MiB without lazy loading), "around 400MB" (pytorch/pytorch#109888),
426 MiB on an RTX 6000 Ada with torch 2.10 + CUDA 13.0 (unslothai/unsloth-zoo#1053), 612 MiB on a B200
(unslothai/unsloth#8669); the kernels a step loads lazily come on top.  :data:`CUDA_CONTEXT` (768 MiB) rounds the
largest up: an assumption, which the device check's ``total - free - reserved`` after a step settles.  ROCm: no
public figure was found (vllm-project/vllm#43236: the HIP runtime's start-up memory is larger than CUDA's);
:data:`ROCM_CONTEXT` keeps the 1 GiB the fit used before, unmeasured.

**NCCL / RCCL** (``world_size > 1``).  NCCL's buffers are its own ``cudaMalloc``s, outside the caching allocator:
per channel and connection one buffer per protocol, ``NCCL_LL_BUFFSIZE`` (512 KiB), ``NCCL_LL128_BUFFSIZE``
(4,800 KiB) and ``NCCL_BUFFSIZE`` (4 MiB, the Simple protocol's) (NVIDIA/nccl ``src/init.cc``, ``DEFAULT_*_BUFFSIZE``;
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize), and "the memory usage is linearly
tied to the number of channels" (NVIDIA/nccl#986).  The allowance is a ring's two connections (its previous and next
rank) over 32 channels (``NCCL_MAX_NCHANNELS``; an H100's NVLink runs 32, NVIDIA/nccl#1685): 588 MiB, against
measured 544 MB for a 2-rank and 688 MB for a 4-rank communicator on 4 A100s over NVLink (NVIDIA/nccl#964).  Not in
it: NVLS (NVSwitch) buffers, all-to-all's per-peer channels, more communicators.  RCCL: about 1 GiB for a rank's
first communicator, 0.65 GiB per further one, measured on LUMI's MI250X (Lumi-supercomputer/LUMI-AI-Guide#111):
:data:`RCCL_BYTES`.

Torch-free: :func:`live_runtime` imports torch when it is asked about the GPU this process runs on.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 2**20
KIB = 2**10

CUDA_CONTEXT = 768 * MIB  # a CUDA 12 context with lazy loading, and the kernels a step loads (an assumption)
ROCM_CONTEXT = 1024 * MIB  # a ROCm context: no public figure found (an assumption, unmeasured)
WORKSPACE_PAIRS = 2  # (BLAS handle, stream) pairs of a training step: the forward's thread, autograd's device thread
NCCL_CHANNELS = 32  # NCCL_MAX_NCHANNELS's ceiling, which an H100's NVLink reaches (NVIDIA/nccl#1685)
NCCL_CONNECTIONS = 2  # a ring's previous and next rank
NCCL_BUFFERS = {"NCCL_LL_BUFFSIZE": 512 * KIB, "NCCL_LL128_BUFFSIZE": 4_915_200, "NCCL_BUFFSIZE": 4 * MIB}
RCCL_BYTES = 1024 * MIB  # a rank's first RCCL communicator, measured on MI250X (LUMI-AI-Guide#111)
BLAS_TERM = "blas workspaces"  # the prediction's breakdown key


@dataclass(frozen=True)
class Runtime:
    """A GPU platform's figures beside a step's tensors, per rank: its context, one (BLAS handle, stream) pair's
    workspaces and the collective library's buffers, each with the words that say where it comes from."""

    platform: str  # "cuda" or "rocm"
    isa: str  # "sm_90", "gfx942"; "" not known (the platform's largest default is taken)
    context_bytes: int
    workspace_bytes: int  # one (handle, stream) pair's BLAS workspaces
    workspace_text: str
    comm: str  # "NCCL" or "RCCL"
    comm_bytes: int  # per rank, in a cell of world_size > 1
    comm_text: str

    @property
    def step_workspace_bytes(self) -> int:
        """The BLAS workspaces a training step holds: :data:`WORKSPACE_PAIRS` pairs."""
        return WORKSPACE_PAIRS * self.workspace_bytes

    def describe(self) -> str:
        """The workspaces a step's peak counts, in words: ``sm_90: 2 x 32.0 MiB BLAS workspaces in each peak (...)``."""
        isa = self.isa or f"{self.platform}, architecture not known"
        return (
            f"{isa}: {WORKSPACE_PAIRS} x {self.workspace_bytes / MIB:,.1f} MiB BLAS workspaces in each peak "
            f"({self.workspace_text})"
        )


def workspace_config(text: str | None) -> int | None:
    """Bytes of a ``CUBLAS_WORKSPACE_CONFIG`` value, as torch parses it: the sum of its ``:SIZE:COUNT`` pairs (KiB);
    None when unset or without a pair (torch then warns and keeps its default)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", text or "")
    return sum(int(size) * KIB * int(count) for size, count in pairs) if pairs else None


def _kib(env: Mapping[str, str], *names: str) -> tuple[int, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value) * KIB, f"{name}={value.strip()}"
    return None


def _switch(env: Mapping[str, str], name: str) -> bool | None:
    """c10's ``check_env``: True for 1/true/yes/on, False for 0/false/no/off, None otherwise (unset)."""
    value = env.get(name, "").strip().lower()
    return True if value in ("1", "true", "yes", "on") else False if value in ("0", "false", "no", "off") else None


def cuda_workspace(isa: str, env: Mapping[str, str]) -> tuple[int, str]:
    """One (cuBLAS handle, stream) pair's workspaces on a CUDA device of ``isa`` ("sm_90"; "": not known, the
    32 MiB default of the newest cards taken), as torch 2.14 sizes them."""
    major = int(isa[3:-1]) if re.fullmatch(r"sm_\d{2,3}", isa) else None
    big = major is None or major in (9, 10, 12)
    default = 4096 * KIB * 8 if big else 4096 * KIB * 2 + 16 * KIB * 8
    configured = workspace_config(env.get("CUBLAS_WORKSPACE_CONFIG"))
    size = configured if configured is not None else default
    if configured is not None:
        where = f"CUBLAS_WORKSPACE_CONFIG={env['CUBLAS_WORKSPACE_CONFIG']}"
    elif major is None:
        where = "cuBLAS's :4096:8 default of the newest cards (architecture not known)"
    else:
        where = f"cuBLAS's {':4096:8' if big else ':4096:2:16:8'} default" + (
            " on compute capability 9-12" if big else ""
        )
    if _switch(env, "TORCH_CUBLASLT_UNIFIED_WORKSPACE") is False:
        lt, lt_where = _kib(env, "CUBLASLT_WORKSPACE_SIZE") or (1024 * KIB, "cuBLASLt's own 1 MiB")
        return size + lt, f"{where}, plus {lt_where} (TORCH_CUBLASLT_UNIFIED_WORKSPACE=0)"
    return size, f"{where}, shared with cuBLASLt"


def rocm_workspace(isa: str, env: Mapping[str, str]) -> tuple[int, str]:
    """One (hipBLAS handle, stream) pair's workspace and its hipBLASLt handle's on a ROCm device of ``isa``
    ("gfx942"; "": not known, gfx94x's 128 MiB taken), as torch 2.14 sizes them."""
    big = not isa or isa.startswith(("gfx94", "gfx95"))
    names = ("CUBLAS_WORKSPACE_CONFIG", "HIPBLAS_WORKSPACE_CONFIG", "ROCBLAS_WORKSPACE_CONFIG")
    name = next((n for n in names if env.get(n) is not None), None)  # the first set is the one torch reads
    configured = workspace_config(env.get(name)) if name else None
    size = configured if configured is not None else (128 if big else 32) * MIB
    where = f"{name}={env[name]}" if configured is not None else f"hipBLAS's default {size // MIB} MiB"
    lt, lt_where = _kib(env, "CUBLASLT_WORKSPACE_SIZE", "HIPBLASLT_WORKSPACE_SIZE") or (
        76 * MIB,
        "hipBLASLt's default 76 MiB",
    )
    return size + lt, f"{where} + {lt_where}"


def nccl_bytes(env: Mapping[str, str]) -> tuple[int, str]:
    """NCCL's buffers per rank, an allowance (see the module's notes): connections x channels x the protocols'
    buffers, each of which its variable may set."""
    per = sum(int(env[n]) if env.get(n, "").isdigit() else size for n, size in NCCL_BUFFERS.items())
    channels = NCCL_CHANNELS
    if env.get("NCCL_MAX_NCHANNELS", "").isdigit():
        channels = min(channels, max(1, int(env["NCCL_MAX_NCHANNELS"])))
    total = NCCL_CONNECTIONS * channels * per
    return total, (
        f"an allowance: {NCCL_CONNECTIONS} ring connections x {channels} channels x {per / MIB:.2f} MiB of LL, "
        "LL128 and Simple buffers (measured 544-688 MB per communicator on A100s: NVIDIA/nccl#964)"
    )


def runtime_for(platform: str, isa: str = "", env: Mapping[str, str] | None = None) -> Runtime:
    """The runtime figures of a ``platform`` ("cuda" or "rocm") device of instruction set ``isa``, under ``env``
    (this process's environment by default)."""
    env = os.environ if env is None else env
    if platform == "rocm":
        space, text = rocm_workspace(isa, env)
        comm_text = "measured ~1 GiB for a rank's first communicator on MI250X (Lumi-supercomputer/LUMI-AI-Guide#111)"
        return Runtime("rocm", isa, ROCM_CONTEXT, space, text, "RCCL", RCCL_BYTES, comm_text)
    space, text = cuda_workspace(isa, env)
    comm, comm_text = nccl_bytes(env)
    return Runtime("cuda", isa, CUDA_CONTEXT, space, text, "NCCL", comm, comm_text)


def platform_of(isa: str) -> str:
    """``rocm`` for a gfx instruction set, else ``cuda``."""
    return "rocm" if isa.startswith("gfx") else "cuda"


def live_runtime(device_type: str) -> Runtime | None:
    """The runtime of the GPU this process runs on (torch's current device: its build, CUDA or ROCm, and its
    instruction set), for a ``device_type`` of ``cuda``; None on the CPU or where torch sees no GPU."""
    if device_type != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if getattr(torch.version, "hip", None):
        return runtime_for("rocm", (getattr(props, "gcnArchName", "") or "").split(":")[0])
    return runtime_for("cuda", f"sm_{props.major}{props.minor}")


def with_runtime(prediction: Any, config: Any, runtime: Runtime | None) -> Any:
    """``prediction`` (a :class:`kdbench.fit.planner.Prediction`) for a GPU of ``runtime``: its step's BLAS
    workspaces added to the peak as their own term (:data:`BLAS_TERM`: they are allocated through the caching
    allocator, so ``max_memory_allocated`` holds them), and for ``world_size > 1`` the collective library's buffers
    per rank set apart in ``comm_bytes`` (outside the allocator: not in the peak).  Unchanged on the CPU (None) and
    for an unpredictable cell."""
    if runtime is None or not prediction.ok or BLAS_TERM in prediction.breakdown:
        return prediction
    space = runtime.step_workspace_bytes
    breakdown = {**prediction.breakdown, BLAS_TERM: space}
    comm = runtime.comm_bytes if config.world_size > 1 else 0
    each = runtime.workspace_bytes / MIB
    note = f"{WORKSPACE_PAIRS} BLAS workspaces of {each:,.1f} MiB added ({runtime.isa or runtime.platform})"
    return dataclasses.replace(
        prediction,
        peak_bytes=prediction.peak_bytes + space,
        breakdown=breakdown,
        comm_bytes=comm,
        notes=(*prediction.notes, note),
    )
