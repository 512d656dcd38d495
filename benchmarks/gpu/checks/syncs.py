"""The syncs stage: a vision distillation step in ``torch.cuda.set_sync_debug_mode("error")`` has no host-device
sync, and tiny-Llama LM steps counted in ``"warn"`` mode: kdbench's fused_linear step none, a liger step exactly
liger-kernel's own (:data:`LIGER_SYNCS`), and transformers' causal-mask builder its own, apart; a cross-tokenizer
(ULD) step none of its own (its tokens staged through pinned buffers, GPU review 4 M7), and a dynamic-cache decode
call none (GPU review 4, M6)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

import torch

from kdbench.distill.lm.impls import unavailable
from kdbench.hw.backends import Backend, choose_autocast
from kdbench.measure.syncs import sync_calls
from kdbench.models import ModelCache
from kdbench.models.generation import GreedyServing, cache_dtype
from kdbench.workloads import workload_of
from kdbench.workloads.placement import hold_for_serving

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
    check_xtok_syncs(backend, report)
    check_decode_syncs(backend, report)


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


def xtok_config():
    """The syncs stage's cross-tokenizer cell: a byte-level teacher, a 1,024-token BPE student, ULD, bf16."""
    return lm_config(
        method="uld",
        loss_impl="fused_linear",
        chunk_size=64,
        overrides={"teacher": {"vocab_size": 256}, "student": {"vocab_size": 1024}},
        data={"kind": "tokens", "seq_len": 128, "tokenizers": {"teacher": "bytes", "student": "bpe:1024"}},
    )


def check_xtok_syncs(backend: Backend, report: Report) -> None:
    """A cross-tokenizer (ULD) step: the host re-tokenizes and aligns every step, and its tokens reach the device
    through pinned buffers copied without blocking (xtok.Staging): none of the step's own synchronising calls."""
    step = cell_step(backend, xtok_config())
    n = LM_SYNC_STEPS
    try:
        for _ in range(2):
            step()
        backend.synchronize()
        with without_packed_check():
            calls = sync_calls(_repeat(step, n), backend)
        report.check(
            f"tiny-Llama uld bytes->bpe:1024 bf16 LM step, {n} steps, transformers' packed-sequence check off: "
            f"{len(calls)} synchronising calls (expected 0: tokens staged through pinned buffers)"
            + (f": {calls[0]}" if calls else ""),
            not calls,
        )
    finally:
        step.close()


def decode_serving(backend: Backend, new_tokens: int = 16) -> GreedyServing:
    """The syncs stage's decode: the tiny-Llama student (32k vocabulary) held in bf16 as a bf16 cell serves it,
    greedy on the dynamic cache from a 1 x 64-token prompt, started (its prefill done)."""
    config = lm_config(data={"kind": "tokens", "seq_len": 64, "prompt_fraction": 0.5})
    workload = workload_of(config)
    torch.manual_seed(0)
    pair = workload.build_pair(config, backend, ModelCache())
    ids, _ = workload.batch(config, 1, backend.device, config.seed + 1, pair)
    lm = pair[1].lm
    lm.eval()
    choice = choose_autocast(backend, config.precision)
    hold_for_serving(lm, choice)
    gen = GreedyServing(lm, ids, new_tokens, None, backend.device_type, {}, cache_dtype(lm, choice))
    gen.choice = choice  # type: ignore[attr-defined]
    with torch.inference_mode(), choice.context(backend.device_type):
        gen.start()
    return gen


def check_decode_syncs(backend: Backend, report: Report) -> None:
    """A dynamic-cache greedy decode call (16 tokens): transformers 5 takes every shape from tensor metadata and
    skips the causal mask at one query, and the loop keeps the tokens on the device: no synchronising call."""
    gen = decode_serving(backend)

    def call() -> None:
        with torch.inference_mode(), gen.choice.context(backend.device_type):  # type: ignore[attr-defined]
            gen.decode()

    call()
    backend.synchronize()
    calls = sync_calls(call, backend)
    major = _version("transformers").split(".")[0]
    expected = "expected 0" if major.isdigit() and int(major) >= 5 else "transformers 4.x may sync per token"
    report.check(
        f"tiny-Llama student bf16 greedy decode, 16 tokens on the dynamic cache, transformers "
        f"{_version('transformers')}: {len(calls)} synchronising calls ({expected})"
        + (f": {calls[0]}" if calls else ""),
        not calls or not expected.startswith("expected"),
    )


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
