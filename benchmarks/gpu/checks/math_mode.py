"""The math stage: the TF32 switches each precision sets, the legacy and the new fp32 flag getters inside
``math_mode`` (torch's compiler reads both; gpu-review-2 G2), and fp32 matmuls and convolutions that are IEEE fp32
by their error against float64 (and TF32's, where the GPU has it)."""

from __future__ import annotations

import torch

from kdbench.core.names import PRECISIONS
from kdbench.hw.backends import Backend, choose_autocast, math_flags, math_mode

from ..report import Report


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


FLAG_GETTERS = (  # name, getter, whether it is a process-wide default level ("none": the levels below decide)
    ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32, False),
    ("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32, False),
    ("get_float32_matmul_precision()", lambda: torch.get_float32_matmul_precision(), False),
    ("backends.fp32_precision", lambda: torch.backends.fp32_precision, True),
    ("cudnn.fp32_precision", lambda: torch.backends.cudnn.fp32_precision, False),
    ("cuda.matmul.fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision, False),
    ("cudnn.conv.fp32_precision", lambda: torch.backends.cudnn.conv.fp32_precision, False),
)


def flag_getters(tf32: bool) -> list[tuple[str, str, bool]]:
    """Inside ``math_mode(tf32)``: every fp32 flag getter this torch has, as (name, value or what it raised,
    agrees with the mode).  IEEE: allow_tf32 False, precision highest or ieee; TF32: True, high or tf32."""
    want = {True, "high", "tf32"} if tf32 else {False, "highest", "ieee"}
    found = []
    with math_mode(tf32):
        for name, getter, inherits in FLAG_GETTERS:
            try:
                value = getter()
            except AttributeError:  # an older torch without the new API
                continue
            except Exception as exc:  # what a getter raises is the finding
                text = (str(exc).strip().splitlines() or [""])[0]
                found.append((name, f"raised {type(exc).__name__}: {text}", False))
                continue
            ok = value in want or (inherits and value == "none")
            found.append((name, repr(value), ok))
    return found


def check_flag_getters(report: Report) -> None:
    """The legacy and the new fp32 flag getters (torch's compiler reads both) inside math_mode (gpu-review-2 G2)."""
    for tf32, mode, want in ((False, "IEEE", "False, 'highest' or 'ieee'"), (True, "TF32", "True, 'high' or 'tf32'")):
        found = flag_getters(tf32)
        shown = ", ".join(f"{name} {value}{'' if ok else ' (WRONG)'}" for name, value, ok in found)
        report.check(f"math_mode({tf32}) ({mode}; expected {want}): {shown}", all(ok for *_, ok in found))


def check_math(backend: Backend, report: Report) -> None:
    report.section("math: the flags each precision sets, and fp32 that is IEEE fp32")
    for precision in PRECISIONS:
        choice = choose_autocast(backend, precision)
        if choice.skip:
            report.check(f"{precision}: skipped here: {choice.skip}", precision == "tf32")
            continue
        with math_mode(choice.tf32):
            flags = math_flags()
        want = precision == "tf32"
        report.check(
            f"{precision}: tf32_matmul {flags['tf32_matmul']}, tf32_cudnn {flags['tf32_cudnn']}, "
            f"float32_matmul_precision {flags['float32_matmul_precision']} (TF32 expected: {want})",
            flags["tf32_matmul"] is want and flags["tf32_cudnn"] is want,
        )
    check_flag_getters(report)
    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device=backend.device)
    b = torch.randn(2048, 2048, device=backend.device)
    x = torch.randn(32, 64, 28, 28, device=backend.device)
    w = torch.randn(128, 64, 3, 3, device=backend.device)
    mm_ref = a.double() @ b.double()
    conv_ref = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    errors = {}
    for tf32 in (False, True):
        if tf32 and not choose_autocast(backend, "tf32").tf32:
            report.unmeasured(choose_autocast(backend, "tf32").skip or "no TF32 here", "math_tf32_error")
            continue
        with math_mode(tf32):
            errors[tf32] = (
                _relative_error(a @ b, mm_ref),
                _relative_error(torch.nn.functional.conv2d(x, w, padding=1), conv_ref),
            )
    mm32, conv32 = errors[False]
    report.figure("math_ieee_error", mm32)
    report.check(
        f"fp32 matmul error {mm32:.2e}, conv error {conv32:.2e} (IEEE fp32: below 1e-5)", max(mm32, conv32) < 1e-5
    )
    if True in errors:
        mm_tf, conv_tf = errors[True]
        report.figure("math_tf32_error", mm_tf)
        report.check(f"tf32 matmul error {mm_tf:.2e}, conv error {conv_tf:.2e} (TF32 in use: above 1e-5)", mm_tf > 1e-5)
