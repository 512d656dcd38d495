"""The syncs stage: a vision distillation step in ``torch.cuda.set_sync_debug_mode("error")`` has no host-device
sync, and tiny-Llama LM steps counted in ``"warn"`` mode: kdbench's fused_linear step none, a liger step exactly
liger-kernel's own (:data:`LIGER_SYNCS`), and transformers' causal-mask builder its own, apart."""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

import torch

from kdbench.distill.lm.impls import unavailable
from kdbench.hw.backends import Backend
from kdbench.measure.syncs import sync_calls

from ..report import Report
from ..steps import cell_step, lm_config, vision_config


def check_syncs(backend: Backend, report: Report) -> None:
    report.section('syncs: distillation steps under torch.cuda.set_sync_debug_mode("error")')
    if backend.device_type != "cuda":
        report.info("no GPU: nothing synchronises on the CPU")
        return
    config = vision_config(
        pair={"teacher": "resnet20", "student": "resnet8"},
        precision="bf16",
        batch_size=64,
        inference={"batch_sizes": [64]},
    )
    step = cell_step(backend, config)
    for _ in range(2):  # lazy initialisation (cuDNN handles, optimizer state) before the check
        step()
    backend.synchronize()
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    except RuntimeError as exc:
        error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    backend.synchronize()
    step.close()
    report.check(
        f"resnet20->resnet8 {config.method} bf16 bs64, 3 steps: "
        + (f"synchronised: {error}" if error else "no host-device sync"),
        not error,
    )
    check_lm_syncs(backend, report)


# liger-kernel's backward, once a step (0.8.5: chunked_loss/fused_linear_distillation.py:299):
# `if torch.ne(grad_output, torch.tensor(1.0, device=grad_output.device))` -- one sync point of the step, which
# torch's sync debug mode reports as two synchronising calls: the scalar's blocking host-to-device copy
# (pytorch/pytorch#120996) and the comparison read back by the `if` (#62092).
LIGER_SYNCS = 2
# transformers, where masking_utils has find_packed_sequence_indices (5.x), reads the position ids back once per
# forward that has neither an attention mask nor a cache, to find packed sequences (`.all()` in an `if`): every LM
# forward of a step, the teacher's and the student's; the model's own, not kdbench's.
TRANSFORMERS_SYNCS_PER_FORWARD = 1
LM_SYNC_STEPS = 3


class without_packed_check:
    """transformers' packed-sequence check off (it finds none): what is left of a step's syncs is kdbench's and
    its loss's.  Nothing where this transformers has no such check."""

    def __enter__(self):
        import transformers.masking_utils as masking

        self.module = masking
        self.saved = getattr(masking, "find_packed_sequence_indices", None)
        if self.saved is not None:
            masking.find_packed_sequence_indices = lambda position_ids: None
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            self.module.find_packed_sequence_indices = self.saved


def lm_sync_expectations(impl: str, packed_check: bool) -> tuple[int, int, str]:
    """(syncs per step with transformers' packed-sequence check off, with it on, why) for an LM step of ``impl``
    with a live teacher: kdbench's own step none, liger's LIGER_SYNCS, transformers' one per forward."""
    own = LIGER_SYNCS if impl == "liger" else 0
    model = 2 * TRANSFORMERS_SYNCS_PER_FORWARD if packed_check else 0
    why = (
        f"liger-kernel's backward: {LIGER_SYNCS} (the host-to-device copy of torch.tensor(1.0) and the `if` on the "
        "comparison, one line)"
        if impl == "liger"
        else "kdbench's LM step is sync-free"
    )
    return own, own + model, why


def check_lm_syncs(backend: Backend, report: Report) -> None:
    """LM steps (tiny Llama, bf16): syncs counted per step in sync debug mode ``"warn"``; kdbench's fused_linear
    step none, a liger step exactly liger-kernel's (said so), and transformers' packed-sequence check apart."""
    try:
        import transformers.masking_utils as masking
    except ImportError as exc:
        report.check(f"LM steps: transformers does not import ({exc}): install kdbench's lm extra", False)
        return
    packed = hasattr(masking, "find_packed_sequence_indices")
    n = LM_SYNC_STEPS
    for impl in ("fused_linear", "liger"):
        why_not = unavailable(impl)
        if why_not:
            report.check(f"tiny-Llama {impl} LM step: not checked: {why_not}", impl == "liger")
            continue
        step = cell_step(backend, lm_config(loss_impl=impl))
        try:
            for _ in range(2):  # lazy initialisation (cuBLAS handles, the optimizer's state) before counting
                step()
            backend.synchronize()
            own, with_model, why = lm_sync_expectations(impl, packed)
            steps = _repeat(step, n)
            with without_packed_check():
                calls = sync_calls(steps, backend)
            report.check(
                f"tiny-Llama {impl} bf16 LM step, {n} steps, transformers' packed-sequence check off: {len(calls)} "
                f"synchronising calls (expected {own} a step: {why})",
                len(calls) == own * n,
            )
            calls = sync_calls(steps, backend)
            model = with_model - own
            report.check(
                f"tiny-Llama {impl} bf16 LM step, {n} steps, as transformers {_version('transformers')} runs it: "
                f"{len(calls)} synchronising calls (expected {with_model} a step: {own} of the step's, {model} of "
                "transformers' causal-mask builder, which reads the position ids back once per forward)",
                len(calls) == with_model * n,
            )
        finally:
            step.close()


def _repeat(fn: Callable[[], object], n: int) -> Callable[[], None]:
    def calls() -> None:
        for _ in range(n):
            fn()

    return calls


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(not installed)"
