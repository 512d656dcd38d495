"""The environment every result row carries, and what `kdbench env` prints."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import psutil
import torch

import kdbench
from kdbench.hw.backends import Backend, detect, math_flags

# Environment variables that change speed; recorded with every row.
KNOB_PREFIXES = (
    "MIOPEN_",
    "PYTORCH_TUNABLEOP_",
    "PYTORCH_MIOPEN_",
    "HIP_",
    "ROCM_",
    "HSA_",
    "HIPBLASLT_",
    "ROCBLAS_",
    "CUDA_",
    "CUBLAS",
    "TORCH_CUDNN_",
    "NCCL_",
    "RCCL_",
    "TORCH_NCCL_",
    "TORCHINDUCTOR_",  # compile: the inductor cache dir, compile threads, max-autotune settings
)
KNOB_NAMES = (
    "TORCH_BLAS_PREFER_HIPBLASLT",
    "TORCH_BLAS_PREFER_CUBLASLT",
    "NVIDIA_TF32_OVERRIDE",
    "GPU_MAX_HW_QUEUES",
    "AMD_SERIALIZE_KERNEL",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "KMP_AFFINITY",
    "OMP_PROC_BIND",
    "HSA_OVERRIDE_GFX_VERSION",
)


def env_knobs(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if k in KNOB_NAMES or k.startswith(KNOB_PREFIXES)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    root = Path(kdbench.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    out = _git(root, "rev-parse", "HEAD")
    return (out.stdout.strip() or None) if out is not None else None


def suite_commit(suite_path: str | Path | None) -> str | None:
    """The git commit of the repository the suite file lies in (12 hex digits, ``+dirty`` when its work
    tree has uncommitted changes), or None outside a git repository: what a history of runs of one
    suite is labelled by (the user's own code, which is not kdbench's ``git_commit``)."""
    if suite_path is None:
        return None
    folder = Path(suite_path).resolve().parent
    out = _git(folder, "rev-parse", "--short=12", "HEAD")
    if out is None or out.returncode != 0 or not out.stdout.strip():
        return None
    dirty = _git(folder, "status", "--porcelain", "--untracked-files=no")
    flag = "+dirty" if dirty is not None and dirty.returncode == 0 and dirty.stdout.strip() else ""
    return out.stdout.strip() + flag


def driver_version(build: str) -> str | None:
    """The GPU kernel driver's version, read from the driver's own files where present."""
    candidates = {
        "cuda": ["/proc/driver/nvidia/version"],
        "rocm": ["/sys/module/amdgpu/version"],
    }.get(build, [])
    for path in candidates:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if build == "cuda":  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
            words = text.splitlines()[0].split()
            nums = [w for w in words if w[:1].isdigit() and "." in w]
            return nums[0] if nums else text.splitlines()[0]
        return text
    if build == "rocm" and Path("/sys/module/amdgpu").is_dir():
        # the amdgpu that ships with the kernel has no version file of its own: the kernel names it
        return f"in-box amdgpu (kernel {platform.release()})"
    return None


def _has_files(folder: Path, patterns: tuple[str, ...]) -> bool:
    try:
        return any(next(folder.rglob(p), None) is not None for p in patterns)
    except OSError:
        return False


def kernel_caches(build: str, environ: dict[str, str] | None = None, home: Path | None = None) -> dict[str, Any]:
    """Whether the tuned-kernel caches were warm when the run started.

    MIOpen (ROCm) keeps its find-db under ``MIOPEN_USER_DB_PATH`` (default
    ``~/.config/miopen``) and compiled kernels under ``MIOPEN_CUSTOM_CACHE_DIR``
    (default ``~/.cache/miopen``); a cold cache makes the first steps search and
    compile.  TunableOp (``PYTORCH_TUNABLEOP_ENABLED=1``) reads its results from
    ``PYTORCH_TUNABLEOP_FILENAME`` (default ``tunableop_results.csv``, with the
    device ordinal before the suffix).  None where the cache does not apply.
    """
    environ = dict(os.environ if environ is None else environ)
    home = Path.home() if home is None else home
    miopen = None
    if build == "rocm":
        db = Path(environ.get("MIOPEN_USER_DB_PATH", home / ".config" / "miopen"))
        kernels = Path(environ.get("MIOPEN_CUSTOM_CACHE_DIR", home / ".cache" / "miopen"))
        miopen = _has_files(db, ("*.udb", "*.ufdb.txt")) or _has_files(kernels, ("*.kdb", "*.ukdb"))
    tunable = None
    if build in ("rocm", "cuda") and environ.get("PYTORCH_TUNABLEOP_ENABLED") == "1":
        name = Path(environ.get("PYTORCH_TUNABLEOP_FILENAME", "tunableop_results.csv"))
        folder = name.parent if str(name.parent) else Path(".")
        tunable = _has_files(folder, (f"{name.stem}*{name.suffix}",))
    return {"miopen_cache_warm": miopen, "tunableop_cache_warm": tunable}


def _speed_knobs() -> dict[str, Any]:
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = None
    return {"cpu_capability": capability, **math_flags()}  # each measurement records its own flags too


def device_facts(backend: Backend) -> dict[str, Any]:
    if backend.device_type == "cuda":
        props = torch.cuda.get_device_properties(backend.device)
        full = getattr(props, "gcnArchName", "") if backend.name == "rocm" else f"sm_{props.major}{props.minor}"
        return {
            "device_name": props.name,
            "device_arch": full.split(":")[0] or None,  # "gfx942:sramecc+:xnack-" groups as gfx942
            "device_arch_full": full or None,
            "device_compute_units": int(props.multi_processor_count),
            "device_memory_bytes": int(props.total_memory),
        }
    return {
        "device_name": cpu_model(),
        "device_arch": platform.machine(),
        "device_arch_full": platform.machine(),
        "device_compute_units": None,
        "device_memory_bytes": int(psutil.virtual_memory().total),
    }


def capture(backend: Backend) -> dict[str, Any]:
    """Environment columns of the results schema, for rows measured on `backend`."""
    import torchvision

    d = detect()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    blas = None
    if backend.device_type == "cuda":
        try:
            blas = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
        except (AttributeError, RuntimeError):
            blas = None
        if backend.name == "rocm":  # torch names the libraries after CUDA's on ROCm too
            blas = {"Cublas": "rocBLAS", "Cublaslt": "hipBLASLt"}.get(blas, blas)
    return {
        **device_facts(backend),
        "device_count": d.gpu_count,
        "driver_version": driver_version(d.build),
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "cuda_version": getattr(torch.version, "cuda", None) if d.build == "cuda" else None,
        "hip_version": getattr(torch.version, "hip", None),
        "cudnn_version": str(cudnn) if cudnn is not None else None,
        "cpu_model": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "python_version": platform.python_version(),
        "kdbench_version": kdbench.__version__,
        "git_commit": git_commit(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "blas_library": blas,
        **_speed_knobs(),
        **kernel_caches(d.build),
        "env_knobs": json.dumps(env_knobs(), sort_keys=True),
    }


def describe_lines() -> list[str]:
    """Human-readable lines for `kdbench env`."""
    from kdbench.hw.backends import resolve

    d = detect()
    lines = [f"backend: {d.best} ({d.describe()})", f"torch build: {d.build}"]
    for i in range(d.gpu_count):
        props = torch.cuda.get_device_properties(i)
        arch = getattr(props, "gcnArchName", "") if d.build == "rocm" else f"sm_{props.major}{props.minor}"
        lines.append(f"device {i}: {props.name}, arch {arch}, {props.total_memory / 2**30:.1f} GiB")
    env = capture(resolve("auto", d))
    lines += [f"{key}: {value}" for key, value in env.items() if key not in ("device_name", "device_arch")]
    return lines
