"""The attention kernel each row ran, and causal attention's FLOPs counted as executed (gpu-review-3 L8, L13).

kdbench/measure/flops.py reads the kernel in the counted call from the aten op each
scaled_dot_product_attention call dispatched to, and counts a causal call on a fused kernel over its
unmasked (query, key) pairs.  On the CPU the real dispatch runs; the GPU kernels are simulated with their
real aten op names on meta tensors, reached through a function the torch-function mode sees as torch's
scaled_dot_product_attention, as the real one is seen."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import handle_torch_function, has_torch_function

from kdbench.hw.backends import resolve
from kdbench.measure.flops import ATTENTION_OPS, attention_flops, causal_pairs, count, kernel_label, pair_label
from kdbench.models.lm import analytic_forward_flops
from tests.support.paths import ROOT

CPU = resolve("cpu")
B, H, S, D = 1, 2, 4, 3  # the tiny attention the FLOPs are computed by hand for


# --------------------------------------------------------------------------- by hand


def test_causal_pairs_are_the_lower_triangle_torch_masks():
    assert causal_pairs(4, 4) == 4 + 3 + 2 + 1 == 10
    assert causal_pairs(1, 4) == 1  # torch's is_causal is aligned top left: query 0 sees key 0
    assert causal_pairs(6, 4) == 10 + 2 * 4
    mask = torch.ones(6, 4, dtype=torch.bool).tril()  # what torch's math path builds for is_causal
    assert int(mask.sum()) == causal_pairs(6, 4)


def test_a_tiny_causal_attention_counts_its_unmasked_pairs_on_the_cpus_flash_kernel():
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    # QKᵀ and PV over the 10 unmasked pairs of each head: 2 FLOPs per multiply-add, D each
    forward = 2 * (B * H * 10 * D) * 2
    assert forward == 240
    counted = count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert counted.flops == forward and counted.attention == Counter(flash=1)
    # without the mask: the whole 4 × 4 square
    assert count(lambda: F.scaled_dot_product_attention(q, k, v)).flops == 2 * (B * H * 16 * D) * 2 == 384
    # an explicit causal mask: the kernel cannot skip blocks, so the square counts whole
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    assert count(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).flops == 384
    # backward: QKᵀ again, dP = dO Vᵀ, dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q, five products over the 10 pairs
    qr = q.clone().requires_grad_()
    both = count(lambda: F.scaled_dot_product_attention(qr, k, v, is_causal=True).sum().backward())
    assert both.flops == forward + 5 * 2 * (B * H * 10 * D) == 240 + 600


def test_the_math_kernel_counts_the_whole_square_it_computes():
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        counted = count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert counted.flops == 384 and counted.attention == Counter(math=1)
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):  # inference mode reaches the mode undecomposed
        assert count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)).attention == Counter(math=1)


def test_grouped_query_attention_counts_every_query_head():
    q = torch.randn(2, 4, 8, 16)
    k, v = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    counted = count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert counted.flops == 2 * 2 * 4 * causal_pairs(8, 8) * (16 + 16)
    assert counted.flops == attention_flops((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), causal=True)


# --------------------------------------------------------------------------- the GPU kernels, simulated

GPU_CALLS = {  # kernel -> the forward op as the CUDA/ROCm dispatch calls it, and its backward
    "flash": (
        lambda q, k, v, c: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, c),
        lambda g, q, k, v, out, c: torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out[0], out[1], out[2], out[3], out[4], out[5], 0.0, c, out[6], out[7]
        ),
    ),
    "mem_efficient": (
        lambda q, k, v, c: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, c),
        lambda g, q, k, v, out, c: torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, torch.empty(0, device="meta"), out[0], out[1], out[2], out[3], 0.0, [True, True, True, False], c
        ),
    ),
    "cudnn": (
        lambda q, k, v, c: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, c),
        None,
    ),
}


def simulated_sdpa(kernel: str):
    """torch's scaled_dot_product_attention as a GPU runs it: a function the torch-function modes see under
    that name, whose body dispatches to ``kernel``'s aten op (here on meta tensors: shapes only)."""
    forward = GPU_CALLS[kernel][0]

    def scaled_dot_product_attention(q, k, v, is_causal=False):
        if has_torch_function((q, k, v)):
            return handle_torch_function(scaled_dot_product_attention, (q, k, v), q, k, v, is_causal=is_causal)
        return forward(q, k, v, is_causal)

    return scaled_dot_product_attention


@pytest.mark.parametrize("kernel", sorted(GPU_CALLS))
def test_a_gpu_kernel_is_recorded_by_its_op_and_its_causal_call_counts_half_the_square(kernel):
    q, k, v = (torch.empty(2, 8, 1024, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    sdpa = simulated_sdpa(kernel)
    causal = count(lambda: sdpa(q, k, v, is_causal=True))
    full = count(lambda: sdpa(q, k, v, is_causal=False))
    assert causal.attention == full.attention == Counter({kernel: 1})
    assert full.flops == 2 * 2 * 8 * 1024 * 1024 * (64 + 64)  # what torch's own formula counts, causal or not
    assert causal.flops == 2 * 2 * 8 * (1024 * 1025 // 2) * (64 + 64)  # the half the kernel executes
    assert causal.flops / full.flops == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("kernel", ["flash", "mem_efficient"])
def test_a_gpu_kernels_backward_counts_the_causal_half_too(kernel):
    q, k, v = (torch.empty(1, 4, 512, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    forward, backward = GPU_CALLS[kernel]
    out = forward(q, k, v, True)
    counted = count(lambda: backward(torch.empty_like(q), q, k, v, out, True))
    assert counted.flops == 2 * 4 * (512 * 513 // 2) * (3 * 64 + 2 * 64)
    assert counted.attention == Counter()  # a backward is not another call


def test_every_fused_op_of_this_torch_is_known():
    ops = {n for n in dir(torch.ops.aten) if n.startswith("_scaled_dot_product_") and not n.endswith("_backward")}
    # the math ones are composite (matmuls and a softmax); overrideable is for backends kdbench has not (XPU ...)
    assert ops - {"_scaled_dot_product_attention_math", "_scaled_dot_product_attention_math_for_mps"} - {
        "_scaled_dot_product_fused_attention_overrideable"
    } == set(ATTENTION_OPS)


# --------------------------------------------------------------------------- labels


def test_labels_name_one_kernel_or_both_models_when_they_differ():
    assert kernel_label(Counter()) is None
    assert kernel_label(Counter(flash=4)) == "flash"
    assert kernel_label(Counter(math=1, flash=4)) == "flash+math"
    assert pair_label(Counter(math=4), Counter(mem_efficient=2)) == "teacher math, student mem_efficient"
    assert pair_label(Counter(flash=4), Counter(flash=2)) == "flash"
    assert pair_label(None, Counter(cudnn=2)) == "cudnn"  # a cached teacher runs nothing in the step
    assert pair_label(Counter(flash=4), Counter()) == "flash"  # a student without SDPA (not an LM)
    assert pair_label(None, Counter()) is None


# --------------------------------------------------------------------------- what the CPU dispatches, on rows


def _lm_step(teacher_math: bool = False):
    from kdbench.config.schema import CellConfig
    from kdbench.distill.step import DistillStep
    from kdbench.models import ModelCache
    from kdbench.workloads.lm.workload import LM

    config = CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "overrides": {"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 1}},
            "method": "forward_kl",
            "batch_size": 2,
            "data": {"kind": "tokens", "seq_len": 16},
        }
    )
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    if teacher_math:  # as an fp32 GQA teacher runs on ROCm: the math kernel
        forward = teacher.forward

        def math_forward(*args, **kwargs):
            with sdpa_kernel(SDPBackend.MATH):
                return forward(*args, **kwargs)

        teacher.forward = math_forward
    x, y = LM.batch(config, 2, CPU.device, 0, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, CPU, LM)
    step()
    return step


def test_an_lm_step_row_records_the_cpus_flash_kernel_and_its_causal_flops():
    from kdbench.measure.step import step_flops

    step = _lm_step()
    try:
        row = step_flops(step)
        assert row["attention_kernel"] == "flash"  # aten._scaled_dot_product_flash_attention_for_cpu
        # the teacher's forward: its matmuls and its 2 layers of causal attention over 16 tokens, as executed
        teacher = step.distiller.teacher
        assert row["teacher_forward_flops"] == analytic_forward_flops(teacher, 2, 16, with_head=False)
    finally:
        step.close()


def test_a_step_whose_teacher_runs_math_says_both_kernels():
    from kdbench.measure.step import step_flops

    step = _lm_step(teacher_math=True)
    try:
        assert step_flops(step)["attention_kernel"] == "teacher math, student flash"
    finally:
        step.close()


def test_an_encoder_forward_records_its_kernel():
    from kdbench.models.encoders import build_encoder

    model = build_encoder("tiny-bert-student", {"num_hidden_layers": 1}, device="cpu")
    ids = torch.randint(0, 100, (2, 16))
    with torch.inference_mode():
        counted = count(lambda: model(input_ids=ids))
    assert counted.attention == Counter(flash=1)  # one layer, bidirectional: the CPU's flash kernel, no mask


# --------------------------------------------------------------------------- the shipped CPU suites' rows


def _shrunk(config, seq_len: dict[int, int], **changes):
    """A shipped cell at a test's size: the same pair, method, loss_impl and rows, shorter sequences, one timed
    call."""
    from kdbench.config.schema import CellConfig

    raw = config.model_dump(mode="json")
    raw["data"]["seq_len"] = seq_len[raw["data"]["seq_len"]]
    raw["timing"] = {"warmup": 0, "min_iters": 1, "min_time_s": 0.0}
    for key, value in changes.items():
        raw[key] = {**(raw.get(key) or {}), **value} if isinstance(value, dict) else value
    return CellConfig.model_validate(raw)


@pytest.mark.slow
@pytest.mark.parametrize(
    "suite,seq_len,changes",
    [
        # a 512-entry vocabulary, 16 and 64 tokens for 256 and 1,024; 2 decoded tokens
        ("llm-cpu", {256: 16, 1024: 64}, {"inference": {"decode_tokens": 2}, "chunk_size": 16}),
        ("encoder-cpu", {128: 16, 512: 64}, {}),
    ],
)
def test_every_row_of_the_shipped_cpu_lm_and_encoder_suites_records_its_attention_kernel(suite, seq_len, changes):
    """Every row of every cell of suites/llm-cpu.yaml (its steps, prefill and decode) and encoder-cpu.yaml (its
    steps and forwards) says which attention kernel ran (gpu-review-3 L8): the CPU's flash, but for the encoder
    student in training, which runs math: BERT's attention dropout (0.1) is on in train mode, and the CPU's flash
    kernel takes no dropout.  llm-cpu's cells differ in their loss_impl too, which runs after the models and
    chooses no kernel: one cell per precision and sequence length is measured (3 of its 15)."""

    from kdbench.config.load import load_suite
    from kdbench.config.plan import Cell, cell_id_of
    from kdbench.models import ModelCache
    from kdbench.run.cell import measure_cell
    from kdbench.workloads import expand_checked, planned_measurements

    path = ROOT / "suites" / f"{suite}.yaml"
    cells = expand_checked(load_suite(path))
    assert len(cells) == (18 if suite == "llm-cpu" else 4)
    measured, cache = set(), ModelCache()  # one per run, as a run's worker holds it
    if suite == "llm-cpu":  # the attention kernel is the models': one cell per (precision, sequence length)
        cells = list({(c.config.precision, c.config.data.seq_len): c for c in reversed(cells)}.values())
        assert len(cells) == 3
    for i, cell in enumerate(cells):
        config = _shrunk(cell.config, seq_len, **changes)
        if suite == "llm-cpu":
            config = config.model_copy(
                update={"overrides": config.overrides.model_copy(update={"teacher": {"vocab_size": 512}})}
            )
            config = config.model_copy(
                update={"overrides": config.overrides.model_copy(update={"student": {"vocab_size": 512}})}
            )
        rows = measure_cell(Cell(i, cell_id_of(config), config), CPU, cache)
        assert [(str(r["measurement"]), r["batch_size"]) for r in rows] == [
            (str(m), b) for m, b in planned_measurements(config)
        ]
        for r in rows:
            assert r["status"] == "ok", r.get("error")
            step = suite == "encoder-cpu" and r["measurement"] == "distill_step"
            want = "teacher flash, student math" if step else "flash"
            assert r["attention_kernel"] == want, (cell.label, r["measurement"])
            measured.add(str(r["measurement"]))
    if suite == "llm-cpu":
        assert measured == {"distill_step", "student_prefill", "student_decode", "teacher_prefill", "teacher_decode"}
    else:
        assert measured == {"distill_step", "student_inference", "teacher_inference"}
