"""Datasheet peaks: dense vendor TFLOP/s per precision, and matching the name torch reports.

Pure data and string matching, no torch, on the base floor beside :mod:`kdbench.core.names`: the
store computes utilisation from it at read time (:mod:`kdbench.store.derived`).
"""

from __future__ import annotations

import re

from kdbench.core.errors import KdbenchError
from kdbench.core.names import PRECISIONS

# Dense peak TFLOP/s (sparsity figures halved back to dense).  tf32 is the TF32 tensor-core
# figure (XF32 on MI300X; None where the device has no such mode).  fp16/bf16 are the matrix
# (Tensor Core / Matrix Core) figures.  fp32 is the plain, non-tensor FP32 figure:
# - NVIDIA: the non-Tensor-Core FP32 number; torch's fp32 matmul does not use TF32
#   unless torch.backends.cuda.matmul.allow_tf32 is set.
# - AMD CDNA: the "FP32 vector" number.  Caveat: on CDNA2 (MI200) the datasheet's
#   "FP32 matrix" figure is twice the vector one, and rocBLAS/hipBLASLt fp32 GEMMs run
#   on the matrix cores, so a measured fp32 matmul there can exceed this peak (up to 2x).
#   On MI300X the matrix and vector FP32 figures are equal.
PEAKS: dict[str, dict[str, float | None]] = {
    # AMD Instinct MI300X datasheet / amd.com MI300X product page: FP32 vector 163.4,
    # TF32 653.7 (1307.4 with sparsity), FP16 and BF16 1307.4 (2614.9 with sparsity).
    "MI300X": {"fp32": 163.4, "tf32": 653.7, "fp16": 1307.4, "bf16": 1307.4},
    # AMD Instinct MI250X datasheet / amd.com MI250X page, whole card (2 GCDs): FP32 vector
    # 47.9, FP16/BF16 383.0; CDNA2 has no TF32/XF32.  Each GCD is its own torch device, so half of the card.  torch
    # names MI250 and MI250X alike ("MI250X/MI250"); an MI250 (45.3 / 362.1) is ~5% slower.
    "MI250X (per GCD)": {"fp32": 47.9 / 2, "tf32": None, "fp16": 383.0 / 2, "bf16": 383.0 / 2},
    # AMD Instinct MI210 datasheet / amd.com MI210 page: FP32 vector 22.6, FP16/BF16 181.0.
    "MI210": {"fp32": 22.6, "tf32": None, "fp16": 181.0, "bf16": 181.0},
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): FP32 67, TF32 989 and FP16/BF16 1,979
    # with sparsity.  Same GH100 SXM5 compute as H100 SXM, whose dense figure is 989.4.
    "H200 SXM": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    # NVIDIA H100 Tensor Core GPU datasheet and "NVIDIA H100 Tensor Core GPU Architecture"
    # whitepaper (SXM5): FP32 67, TF32 494.7 and FP16/BF16 989.4 dense (989 / 1,979 with sparsity).
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    # Same datasheet / whitepaper, H100 PCIe: FP32 51, TF32 378 and FP16/BF16 756 dense (756 / 1,513 sparse).
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    # NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, TF32 156 (312 sparse), FP16/BF16 312 (624 sparse);
    # the same for 40GB and 80GB, PCIe and SXM.
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3, TF32 120 and FP16/BF16 242 with sparsity -> 60 and 121.
    "L4": {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
    # NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1, mixed-precision FP16 65; Turing has no bf16 or TF32.
    "T4": {"fp32": 8.1, "tf32": None, "fp16": 65.0, "bf16": None},
}

# Whole-name patterns (lower case, spaces collapsed) for what torch.cuda.get_device_name
# reports.  Whole-name matching keeps variants with other figures (MI300A, MI325X, H100 NVL,
# H200 NVL, A10, A100X ...) from borrowing a sibling's peak: they return None.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"amd instinct mi300x( vf)?", "MI300X"),
    (r"amd instinct mi250x(/mi250)?", "MI250X (per GCD)"),
    (r"amd instinct mi210", "MI210"),
    (r"nvidia h200", "H200 SXM"),
    (r"nvidia h100( sxm5?)? 80gb hbm3", "H100 SXM"),
    (r"nvidia h100 pcie", "H100 PCIe"),
    (r"nvidia a100-(sxm4|pcie)-(40|80)gb|nvidia a100 80gb pcie", "A100"),
    (r"nvidia l4", "L4"),
    (r"(tesla|nvidia) t4", "T4"),
)


# The full chip's compute units (AMD CUs, NVIDIA SMs) behind each peak.  A device with fewer (an
# MI300X in CPX or DPX compute-partition mode shows 38 or 152 of its 304 CUs under the full card's
# name) gets the peak scaled to its share.
FULL_UNITS: dict[str, int] = {
    "MI300X": 304,
    "MI250X (per GCD)": 110,
    "MI210": 104,
    "H200 SXM": 132,
    "H100 SXM": 132,
    "H100 PCIe": 114,
    "A100": 108,
    "L4": 58,
    "T4": 40,
}

# ROCm releases and virtual functions where the marketing name is empty or generic: the
# architecture (and the CU count, where one architecture has several parts) names the part.
_ARCH_FALLBACK: tuple[tuple[str, int | None, str], ...] = (
    ("gfx942", None, "MI300X"),  # MI325X shares MI300X's compute and peaks
    ("gfx90a", 110, "MI250X (per GCD)"),
    ("gfx90a", 104, "MI210"),
)


def datasheet_peak(
    device_name: str, dtype: str, units: int | None = None, arch: str | None = None
) -> tuple[str, float] | None:
    """(name, dense peak TFLOP/s) for a GPU as torch reports it; None for CPUs, unknown devices, and
    dtypes the device lacks.  ``units`` (compute units torch sees) scales the peak of a partitioned
    device; ``arch`` names the part where the name does not."""
    if dtype not in PRECISIONS:
        raise KdbenchError(f"unknown dtype '{dtype}'; use {', '.join(PRECISIONS)}")
    name = " ".join(device_name.lower().split())
    canonical = next((c for pattern, c in _NAME_PATTERNS if re.fullmatch(pattern, name)), None)
    if canonical is None and arch:
        canonical = next((c for a, cus, c in _ARCH_FALLBACK if arch.split(":")[0] == a and cus in (None, units)), None)
    if canonical is None or PEAKS[canonical][dtype] is None:
        return None
    peak, full = PEAKS[canonical][dtype], FULL_UNITS[canonical]
    if units and 0 < units < full:
        return f"{canonical} ({units} of {full} CUs)", peak * units / full
    return canonical, peak
