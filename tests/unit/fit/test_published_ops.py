"""The published GPU rows (tests/data/published/) and the fake runs that price them (benchmarks/published_*.py):
the file holds what its README says, a row's FLOPs and bytes are the hand formula's, and torch's plain roofline is
its arithmetic."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from kdbench.core.devices import find_card
from tests.support.paths import ROOT

BENCHMARKS = ROOT / "benchmarks"
GPUS = {"NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA B200"}
KERNELS = {
    "cross_entropy",
    "kl_div",
    "jsd",
    "tvd",
    "fused_linear_cross_entropy",
    "fused_linear_jsd",
    "distill_jsd_loss",
}


@pytest.fixture(scope="module")
def pub():
    """published_ops, published_census and published_liger, imported as the benchmark imports them (benchmarks/ on
    sys.path: it is not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        names = ("published_ops", "published_census", "published_liger")
        yield type("Modules", (), {n.split("_")[1]: importlib.import_module(n) for n in names})
    finally:
        sys.path.remove(str(BENCHMARKS))


def _row(pub, kernel, provider, mode, x):
    found = [r for r in pub.ops.load_rows() if (r.kernel, r.provider, r.mode, r.x) == (kernel, provider, mode, x)]
    assert len(found) == 1
    return found[0]


def test_the_file_holds_the_kernels_devices_and_sweeps_its_readme_lists(pub):
    rows = pub.ops.load_rows(metric=None)
    assert len(rows) == 260
    assert sum(r.metric == "speed" for r in rows) == 180 and sum(r.metric == "memory" for r in rows) == 80
    assert {r.kernel for r in rows} == KERNELS and {r.gpu for r in rows} == GPUS
    assert {r.provider for r in rows} == {"liger", "torch", "huggingface"}
    speed = pub.ops.load_rows()
    assert {(r.unit, r.metric) for r in speed} == {("ms", "speed")}
    sweep: dict[tuple[str, str], set[int]] = {}
    for r in speed:
        sweep.setdefault((r.kernel, r.gpu), set()).add(r.x)
    assert sweep[("kl_div", "NVIDIA H100 PCIe")] == {2**i for i in range(12, 18)}
    assert sweep[("jsd", "NVIDIA B200")] == {1024, 2048, 4096, 8192}
    assert sweep[("fused_linear_cross_entropy", "NVIDIA A100-SXM4-80GB")] == {4096, 8192, 16384, 32768}
    # each row's median lies between its 20th and 80th percentiles (read in the right columns)
    assert all(r.p20 <= r.p50 <= r.p80 for r in rows)
    row = _row(pub, "distill_jsd_loss", "torch", "full", 8192)
    assert row.p50 == pytest.approx(213.160, abs=1e-3)
    assert row.config["H"] == 4096 and row.config["V"] == 128256 and row.precision == "bf16"
    assert _row(pub, "kl_div", "liger", "forward", 4096).precision == "fp32"


def test_every_device_but_the_b200_is_in_the_catalogue(pub):
    names = {g: (find_card(g).name if find_card(g) else None) for g in GPUS}
    assert names["NVIDIA A100-SXM4-80GB"] == "A100 80GB"
    assert names["NVIDIA H100 PCIe"] == "H100 PCIe"
    assert names["NVIDIA H100 80GB HBM3"] == "H100 80GB"


def test_a_fused_linear_cross_entropy_row_counts_the_head_matmuls_flops(pub):
    """huggingface's (BT, H) x (H, V) head: 2·BT·H·V forward; its backward adds the input's and the weight's
    gradients, 4·BT·H·V more; kdbench's census counts the same, and kdbench's dense at the same shapes too."""
    bt, h, v = 4096, 4096, 128256
    fwd = pub.census.run_fake(
        pub.ops.operation(_row(pub, "fused_linear_cross_entropy", "huggingface", "forward", bt)).build
    )
    assert fwd.flops == 2 * bt * h * v == fwd.census.flops
    full_row = _row(pub, "fused_linear_cross_entropy", "huggingface", "full", bt)
    full = pub.census.run_fake(pub.ops.operation(full_row).build)
    assert full.flops == 6 * bt * h * v == full.census.flops
    twin = pub.census.run_fake(pub.ops.kdbench_twin(full_row).build)
    assert twin.flops == 6 * bt * h * v


def test_the_distillation_loss_counts_both_heads_and_the_student_gradients(pub):
    """Student (BT, 2,048), teacher (BT, 4,096) heads over 128,256: forward 2·BT·V·(2,048 + 4,096); backward the
    student's two gradients, 2 x 2·BT·V·2,048 (the teacher's head runs under no_grad)."""
    bt, v = 1024, 128256
    fwd = pub.census.run_fake(pub.ops.operation(_row(pub, "distill_jsd_loss", "torch", "forward", bt)).build)
    assert fwd.flops == 2 * bt * v * (2048 + 4096)
    full = pub.census.run_fake(pub.ops.operation(_row(pub, "distill_jsd_loss", "torch", "full", bt)).build)
    assert full.flops == 2 * bt * v * (2048 + 4096) + 2 * 2 * bt * v * 2048


def test_the_plain_roofline_of_a_kl_row_by_hand(pub):
    """nn.KLDivLoss(batchmean) of (16,384, 4,096) float32 runs xlogy(t, t) - t · x, a sum and a division: mul,
    xlogy and sub each read two tensors and write one, the sum reads one (N = 16,384 x 4,096 x 4 B): 10 N + 12 B,
    over the H100 PCIe's 2,000 GB/s (no FLOPs: torch counts none for elementwise work)."""
    row = _row(pub, "kl_div", "torch", "forward", 4096)
    fake = pub.census.run_fake(pub.ops.operation(row).build)
    n = 16384 * 4096 * 4
    assert [op.name for op in fake.ops] == ["aten.mul", "aten.xlogy", "aten.sub", "aten.sum", "aten.div"]
    assert fake.bytes == 10 * n + 12 and fake.flops == 0
    card = find_card(row.gpu)
    assert card.memory_bandwidth == 2000.0
    assert pub.census.roofline_ms(fake.ops, card) == pytest.approx((10 * n + 12) / 2000e9 * 1e3, rel=1e-12)


def test_a_matmul_is_priced_at_the_dtypes_peak_and_an_elementwise_op_at_the_bandwidth(pub):
    """max(FLOPs / peak, bytes / bandwidth), the peak the output dtype's: bf16's 312 TFLOP/s on an A100 for the
    head's mm; its float32 output would be priced at fp32's 19.5."""
    card = find_card("A100 80GB")
    op = pub.census.Op("aten.mm", 2 * 4096 * 4096 * 128256, 2 * (4096 * 4096 + 4096 * 128256 * 2), None)
    bf16 = pub.census.Op(op.name, op.flops, op.bytes, torch.bfloat16)
    assert pub.census.op_ms(bf16, card) == pytest.approx(op.flops / 312e12 * 1e3)
    assert pub.census.op_ms(op, card) == pytest.approx(op.flops / 19.5e12 * 1e3)
    copy = pub.census.Op("aten.add", 0, 3 * 2**30, bf16.dtype)
    assert pub.census.op_ms(copy, card) == pytest.approx(3 * 2**30 / 2039e9 * 1e3)


def test_a_liger_kernel_is_one_operator_with_the_bytes_its_source_moves(pub):
    """Liger's cross-entropy kernel (0.2.1) reads each row of logits twice (the online max and sum, then the
    gradient), the targets once, and writes the gradient over the logits and a loss per row."""
    row = _row(pub, "cross_entropy", "liger", "forward", 4096)
    fake = pub.census.run_fake(pub.ops.operation(row).build)
    kernels = [op for op in fake.ops if op.name.startswith("liger.")]
    rows, x = 16384, 16384 * 4096 * 4
    assert [op.name for op in kernels] == ["liger.cross_entropy"]
    assert kernels[0].bytes == 3 * x + rows * 8 + rows * 4
    (record,) = [r for r in fake.census.records if r.op == "liger.cross_entropy"]
    assert (record.read, record.written, record.launches) == (2 * x + rows * 8, x + rows * 4, 1)


def test_liger_fused_linear_chunks_as_its_source_does(pub):
    """chunk = next_power_of_2(cdiv(BT, cdiv(V, H))): 32 chunks at V 128,256 and H 4,096, whatever BT."""
    chunking = pub.liger._chunking
    assert chunking(4096, 128256, 4096) == (128, 32)
    assert chunking(32768, 128256, 4096) == (1024, 32)
    assert chunking(1000, 128256, 4096) == (32, 32)
    row = _row(pub, "fused_linear_jsd", "liger", "forward", 1024)
    fake = pub.census.run_fake(pub.ops.operation(row).build)
    assert sum(op.name == "liger.jsd" for op in fake.ops) == 32


def test_full_mode_accumulates_into_the_gradient_made_by_the_untimed_call(pub):
    """do_bench repeats the call: after the first, the leaf's .grad exists and the backward adds into it (a
    read-modify-write of the (rows, V) gradient the roofline must count), as the untimed first call arranges."""
    row = _row(pub, "cross_entropy", "huggingface", "full", 4096)
    fake = pub.census.run_fake(pub.ops.operation(row).build)
    assert "aten.add_" in [op.name for op in fake.ops]
    assert {r.phase for r in fake.census.records} == {"forward", "backward"}
