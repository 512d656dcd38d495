"""The fit planner's fake run for a GPU target (gpu-review-4 M5, kdbench.fit.gpu_target): CUDA's autocast lists,
SDPA with dropout counted as the fused kernel's, a CUDA sort's CUB workspace; a CPU target and a Llama cell as
before.  Every expected byte count is worked out from the shapes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kdbench.config.schema import CellConfig
from kdbench.fit import gpu_target
from kdbench.fit.gpu_target import GpuTarget, cuda_autocast_lists, sort_workspace_bytes
from kdbench.fit.planner import predict
from kdbench.fit.tracker import LiveBytes
from kdbench.models.lm import build_lm

pytestmark = pytest.mark.usefixtures("one_thread")
BF16 = torch.bfloat16
LLAMA = {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"}
BERT = {"teacher": "tiny-bert-teacher", "student": "tiny-bert-student"}
B, S = 4, 128
HEADS, STUDENT_LAYERS = 4, 2  # tiny-bert-student: 2 layers x 64, 4 heads
SCORES = B * HEADS * S * S  # elements of one layer's (B, H, S, S) attention matrix


def encoder(precision: str = "bf16", method: str = "minilm", **overrides) -> CellConfig:
    return CellConfig.model_validate(
        {
            "pair": BERT,
            "method": method,
            "batch_size": B,
            "data": {"kind": "tokens", "seq_len": S},
            "precision": precision,
            "teacher_precision": precision,
            "overrides": {"teacher": dict(overrides), "student": dict(overrides)},
        }
    )


# ------------------------------------------------------------------ the lists


def _macro(text: str, name: str) -> set[str]:
    body = re.search(rf"#define {name}\(_\)(.*?)\n\n", text, re.S).group(1)
    return {".".join(p.strip() for p in m.split(",")) for m in re.findall(r"_\(([^()]*)\)", body)}


def test_the_lists_are_this_torchs_cuda_autocast_lists():
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if header.exists():  # the wheel ships it: the transcription is the macros' text
        text = header.read_text()
        assert _macro(text, "AT_FORALL_FP32") == set(gpu_target.CUDA_FP32)
        assert _macro(text, "AT_FORALL_FP32_SET_OPT_DTYPE") == set(gpu_target.CUDA_FP32_SET_OPT_DTYPE)
        assert _macro(text, "AT_FORALL_PROMOTE") == set(gpu_target.CUDA_PROMOTE)
        assert _macro(text, "AT_FORALL_LOWER_PRECISION_FP") == set(gpu_target.CUDA_LOWER_PRECISION_FP)
    listed = {
        *gpu_target.CUDA_LOWER_PRECISION_FP,
        *gpu_target.CUDA_FP32,
        *gpu_target.CUDA_FP32_SET_OPT_DTYPE,
        *gpu_target.CUDA_FP32_APPEND_DTYPE,
        *gpu_target.CUDA_PROMOTE,
        *gpu_target.CUDA_BANNED,
    }
    names = torch._C._dispatch_get_all_op_names()
    cuda = {  # aten's own: other libraries' ops (torchvision::nms, ...) register their autocast kernels when imported
        n.removeprefix("aten::")
        for n in names
        if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")
    }
    # every listed op is one CUDA's autocast has; what it has beyond them never runs on a CPU tensor (cuDNN's) or
    # is registered outside the lists (left with the CPU's kernel): a torch that adds an op to the lists fails here
    assert listed <= cuda
    assert cuda - listed <= {"cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn", "linalg_matrix_sqrth"}


# ------------------------------------------------------------------ autocast


def _live_after(device_type: str, op, dtype=BF16, n: int = 1000) -> tuple[int, int, torch.dtype]:
    """(live bytes added, peak bytes added, output dtype) of ``op`` on a fake (n,) ``dtype`` tensor under the
    CPU's autocast with the fake run of ``device_type``."""
    meter = LiveBytes()
    with FakeTensorMode(), meter, GpuTarget(device_type, meter):
        x = torch.empty(4, n // 4, dtype=dtype)
        meter.reset_peak()
        before = meter.live
        with torch.autocast("cpu", dtype=dtype):
            y = op(x)
        return meter.live - before, meter.peak.bytes - before, y.dtype


@pytest.mark.parametrize(
    "op",
    [
        lambda x: torch.softmax(x, -1),
        lambda x: F.log_softmax(x, -1),
        lambda x: F.layer_norm(x, (x.shape[-1],)),
        lambda x: x.exp(),
        lambda x: x**2,
        lambda x: torch.rsqrt(x),
        lambda x: x.sum(-1),
        lambda x: torch.logsumexp(x, -1),
        lambda x: x.cumsum(-1),
    ],
    ids=["softmax", "log_softmax", "layer_norm", "exp", "pow", "rsqrt", "sum", "logsumexp", "cumsum"],
)
def test_cudas_fp32_ops_return_float32_from_bf16_for_a_gpu_and_bf16_for_the_cpu(op):
    assert _live_after("cuda", op)[2] == torch.float32
    assert _live_after("rocm", op)[2] == torch.float32
    assert _live_after("cpu", op)[2] == BF16


def test_the_meter_sees_the_float32_output_and_the_cast_cuda_makes():
    n = 1000
    softmax = lambda x: torch.softmax(x, -1)  # noqa: E731
    # the CPU: a bf16 output (2 bytes an element)
    assert _live_after("cpu", softmax)[:2] == (2 * n, 2 * n)
    # CUDA, bf16: softmax(x, dtype=float32) converts x to float32 first (SoftMax.cpp), then a float32 output;
    # the copy dies with the call
    assert _live_after("cuda", softmax)[:2] == (4 * n, 8 * n)
    # CUDA, fp16: the half-to-float kernel makes no copy
    assert _live_after("cuda", softmax, torch.float16)[:2] == (4 * n, 4 * n)


def test_the_registrations_go_with_the_context():
    with FakeTensorMode():
        x = torch.empty(8, 8, dtype=BF16)
        with cuda_autocast_lists(), torch.autocast("cpu", dtype=BF16):
            assert torch.softmax(x, -1).dtype == torch.float32
            with cuda_autocast_lists():  # nested: registered once
                assert x.exp().dtype == torch.float32
            assert torch.softmax(x, -1).dtype == torch.float32
        with torch.autocast("cpu", dtype=BF16):
            assert torch.softmax(x, -1).dtype == BF16 and x.exp().dtype == BF16
            # the CPU's own list is back: mse_loss is float32 under it, cat promotes
            assert F.mse_loss(x, x).dtype == torch.float32


def test_an_eager_encoder_cell_holds_float32_attention_probabilities_and_bool_dropout_masks_on_a_gpu():
    config = encoder(attn_implementation="eager")
    cpu, cuda = predict(config, "cpu"), predict(config, "cuda")
    assert cpu.ok and cuda.ok, (cpu.error, cuda.error)
    assert cpu.phase == cuda.phase == "loss"
    # What the student's backward keeps (train mode, dropout 0.1; the teacher runs under no_grad: nothing kept):
    # - per layer, of the eager attention, in bytes per (B, H, S, S) element:
    #   CPU:  softmax's bf16 output 2, the dropout's bf16 noise 2, the dropout's bf16 output 2          = 6
    #   GPU:  softmax's float32 output 4, native_dropout's bool mask 1, the bf16 cast of its float32
    #         output that the value matmul makes and saves 2                                             = 7
    # - per layer, two hidden dropouts of bf16 (B, S, hidden) sublayer outputs: a bf16 noise (2) against a
    #   bool mask (1); and the embeddings' dropout of their float32 LayerNorm output: float32 noise (4) against 1
    # The LayerNorms take the float32 residual stream (a bf16 sublayer + the float32 embeddings) on both.
    hidden = B * S * 64  # tiny-bert-student's hidden size
    per_layer = (7 - 6) * SCORES - 2 * (2 - 1) * hidden
    assert cuda.peak_bytes - cpu.peak_bytes == STUDENT_LAYERS * per_layer - (4 - 1) * hidden


# ------------------------------------------------------------------ attention


@pytest.mark.parametrize(("precision", "noise_bytes"), [("bf16", 2), ("fp32", 4)])
def test_a_dropout_encoder_cell_is_predicted_with_no_s_by_s_on_a_gpu(precision, noise_bytes, monkeypatch):
    shapes: dict[str, list[tuple[int, ...]]] = {}
    count = LiveBytes._count

    def seen(self, t, kind=None):
        shapes[target].append(tuple(t.shape))
        return count(self, t, kind)

    monkeypatch.setattr(LiveBytes, "_count", seen)
    # BERT's attention_probs_dropout_prob 0.1: the CPU's SDPA runs the math kernel.  hidden_mse: a loss that
    # makes no (S, S) tensor of its own (minilm's relations are)
    dropout = encoder(precision, "hidden_mse")
    found = {}
    for target, config in [("cpu", dropout), ("cuda", dropout), ("cuda no attention dropout", None)]:
        shapes[target] = []
        config = config or encoder(precision, "hidden_mse", attention_probs_dropout_prob=0.0)
        found[target] = predict(config, target.split()[0])
        assert found[target].ok, found[target].error
    cpu, cuda = found["cpu"], found["cuda"]
    square = {target: [s for s in made if len(s) == 4 and s[-2:] == (S, S)] for target, made in shapes.items()}
    assert square["cpu"] and not square["cuda"]  # the math kernel's (B, H, S, S) tensors on the CPU only
    # on a GPU, attention dropout moves no byte: the fused kernel keeps its output and logsumexp either way
    assert cuda.peak_bytes == found["cuda no attention dropout"].peak_bytes
    assert any("fused kernel" in n for n in cuda.notes) and not cpu.notes
    # the CPU's math kernel keeps per student layer at least float32 probabilities (4 B an element), the dropout
    # noise (4) and the dropped probabilities (4), while the GPU's hidden dropouts keep bool masks instead of noise
    assert cpu.peak_bytes - cuda.peak_bytes >= (4 + 4 + 4) * SCORES * STUDENT_LAYERS
    # without attention dropout the CPU runs flash too: what differs is the hidden dropouts' masks, 2 per layer
    # on (B, S, hidden) sublayer outputs of the cell's dtype and 1 on the embeddings' float32 output
    flash = predict(encoder(precision, "hidden_mse", attention_probs_dropout_prob=0.0), "cpu")
    hidden = B * S * 64
    saved = STUDENT_LAYERS * 2 * (noise_bytes - 1) * hidden + (4 - 1) * hidden
    assert flash.peak_bytes - cuda.peak_bytes == saved


# ------------------------------------------------------------------ Llama


def test_a_llama_cell_predicts_the_same_peak_for_a_gpu_as_for_the_cpu():
    """RMSNorm and rotary upcast explicitly and kdbench's loss runs with autocast off: CUDA's lists change no
    tensor of the step, and its SDPA has no dropout."""
    config = CellConfig.model_validate(
        {
            "pair": LLAMA,
            "method": "forward_kl",
            "batch_size": 2,
            "data": {"kind": "tokens", "seq_len": 128},
            "precision": "bf16",
            "teacher_precision": "bf16",
        }
    )
    cpu, cuda = predict(config, "cpu"), predict(config, "cuda")
    assert cpu.ok and cuda.ok
    assert (cuda.peak_bytes, cuda.phase, cuda.breakdown) == (cpu.peak_bytes, cpu.phase, cpu.breakdown)
    assert cuda.notes == ()


# ------------------------------------------------------------------ sort


@pytest.mark.parametrize(
    ("rows", "vocab", "per_element"),
    [
        (200, 8192, 8 + (4 + 8)),  # 128+ segments: reverse indices + CUB's third key and value buffer
        (64, 8192, 2 * 8 + 4 + (4 + 8)),  # 2-127 segments: two int2 buffers, CUB's keys_out, its third buffers
        (1, 8192, 8 + (4 + 8)),  # one segment: the index buffer and CUB's third key and value buffer
        (64, 4096, 0),  # up to 4,096: an in-place bitonic sort
    ],
)
def test_a_gpu_sort_holds_cubs_buffers_beside_its_outputs(rows, vocab, per_element):
    n = rows * vocab
    assert sort_workspace_bytes((rows, vocab), -1, 4) == per_element * n
    peaks = {}
    for device_type in ("cpu", "cuda"):
        meter = LiveBytes()
        with FakeTensorMode(), meter, GpuTarget(device_type, meter) as target:
            x = torch.empty(rows, vocab)
            meter.reset_peak()
            _ = x.sort(dim=-1, descending=True)  # values and indices, alive
            peaks[device_type] = meter.peak.bytes
            assert meter.live == 4 * n + 4 * n + 8 * n  # the workspace is gone after the sort
        counted = device_type == "cuda" and per_element > 0
        assert any("CUB workspace" in note for note in target.notes) == counted
    assert peaks["cpu"] == (4 + 4 + 8) * n  # input, values, int64 indices
    assert peaks["cuda"] == peaks["cpu"] + per_element * n


def test_sort_workspace_is_per_batch_of_int_max_elements():
    # 2**20 rows of 4,097: torch sorts floor((2**31 - 1) / 4097) rows at a time
    rows_per_batch = (2**31 - 1) // 4097
    assert sort_workspace_bytes((2**20, 4097), -1, 2) == rows_per_batch * 4097 * (8 + 2 + 8)


def test_a_uld_cell_counts_the_sort_workspace_on_a_gpu_only():
    vocab = 8192  # over 4,096: CUB's radix sort
    config = CellConfig.model_validate(
        {
            "pair": LLAMA,
            "method": "uld",
            "loss_impl": "chunked",
            "chunk_size": 64,
            "batch_size": 2,
            "data": {"kind": "tokens", "seq_len": 64},
            "overrides": {
                "teacher": {"vocab_size": vocab, "num_hidden_layers": 1},
                "student": {"vocab_size": vocab, "num_hidden_layers": 1},
            },
            "inference": {"batch_sizes": []},
        }
    )
    cpu, cuda = predict(config, "cpu"), predict(config, "cuda")
    assert cpu.ok and cuda.ok, (cpu.error, cuda.error)
    # a 64-row chunk's (64, 8192) float32 probabilities: 2-127 segments, 32 B an element = 16 MiB
    assert not cpu.notes and any("CUB workspace" in n and "16.0 MiB" in n for n in cuda.notes), cuda.notes
    assert 0 < cuda.peak_bytes - cpu.peak_bytes <= 64 * vocab * 32


# ------------------------------------------------------------------ the optimizer's default


def test_a_default_optimizer_runs_as_torchs_foreach_on_a_gpu_and_per_tensor_on_the_cpu():
    """Rule 5: ``optimizer.impl: default`` is what torch picks for the device: on a GPU the multi-tensor foreach
    update, whose ``_foreach_sqrt`` holds a float32 copy of every second moment at once (the per-tensor loop holds
    one parameter's sqrt and its quotient), one launch per operation."""

    def cell(impl: str) -> CellConfig:
        return CellConfig.model_validate(
            {
                "pair": LLAMA,
                "method": "forward_kl",
                "batch_size": 2,
                "data": {"kind": "tokens", "seq_len": 128},
                "precision": "fp32",
                "optimizer": {"name": "adamw", "lr": 1e-4, "impl": impl},
            }
        )

    cpu, cuda = predict(cell("default"), "cpu", phase_peaks=True), predict(cell("default"), "cuda", phase_peaks=True)
    foreach = predict(cell("foreach"), "cpu", phase_peaks=True)
    assert cpu.ok and cuda.ok and foreach.ok

    def optimizer(p) -> tuple[int, int]:
        launches = sum(r.launches for r in p.census.records if r.phase == "optimizer")
        return p.phase_peaks["optimizer"][0], launches

    assert optimizer(cuda) == optimizer(foreach)  # the GPU's default is the foreach update, to the byte
    (cpu_peak, cpu_launches), (gpu_peak, gpu_launches) = optimizer(cpu), optimizer(cuda)
    params = [p.numel() * 4 for p in build_lm("tiny-llama-student", None).parameters()]
    # all the sqrts at once, against the largest parameter's sqrt and quotient (the step counters' bytes aside)
    assert abs((gpu_peak - cpu_peak) - (sum(params) - 2 * max(params))) <= 1024
    assert cpu_launches > 5 * len(params) and gpu_launches < 20
