"""The fit's headroom on a GPU (GPU review 4, M4): a card's total as torch reports it (a cited print), less the
runtime's context, with a fragmentation allowance on the step's peak rather than on the card; the GPU this process
runs on read from mem_get_info; the BLAS workspaces as a term of a GPU's prediction and NCCL/RCCL buffers beside it.
Every GPU here is simulated (torch.cuda monkeypatched): the arithmetic is checked by hand from the cited figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kdbench.fit.planner as planner
from kdbench.core.devices import CATALOGUE
from kdbench.core.sizes import GB, GIB
from kdbench.fit.cells import fit_cells
from kdbench.fit.columns import fit_columns, prediction_of
from kdbench.fit.devices import FRAGMENTATION, find_device, headroom_figures, sized_device, this_gpu, usable
from kdbench.fit.planner import Prediction
from kdbench.fit.runtime import (
    BLAS_TERM,
    CUDA_CONTEXT,
    RCCL_BYTES,
    ROCM_CONTEXT,
    runtime_for,
    with_runtime,
    workspace_config,
)
from kdbench.fit.verdict import FITS, NO_FIT, Predictor, judge
from tests.support.helpers import make_config

MIB = 2**20
KIB = 2**10
NCCL_PER_RANK = 2 * 32 * (512 * KIB + 4_915_200 + 4 * MIB)  # ring connections x channels x LL + LL128 + Simple


def _peak(nbytes: int, world_size: int = 1) -> Prediction:
    return Prediction(nbytes, phase="loss", breakdown={"activations": nbytes}, host="host")


# --------------------------------------------------------------------------- usable on the table's cards


def test_an_h100s_usable_memory_is_torchs_79_11_gib_less_the_context_over_the_fragmentation_share():
    h100 = find_device("H100", live=False)
    total = round(79.11 * GIB)  # vllm-project/vllm#27508: "GPU 0 has a total capacity of 79.11 GiB"
    assert h100.total_bytes == total and "79.11 GiB" in h100.total_source and "github.com" in h100.total_source
    assert CUDA_CONTEXT == 768 * MIB and FRAGMENTATION == 0.05
    assert usable(h100) == int((total - 768 * MIB) / 1.05) == 80_131_818_408  # 74.63 GiB
    # the old model: (80e9 - 1 GiB) x 0.95 = 69.83 GiB, under the docs' own 71.75 GiB 8B -> 1B cell
    assert usable(h100) > 71.75 * GIB + 2 * 32 * MIB > int((80 * GB - GIB) * 0.95)


def test_an_h200_keeps_its_datasheet_figure_where_no_print_of_torchs_total_was_found():
    h200 = find_device("H200", live=False)
    assert h200.total_bytes is None and "datasheet's figure stands in" in h200.total_source
    assert usable(h200) == int((141 * GB - 768 * MIB) / 1.05) == 133_518_755_840  # 124.35 GiB
    assert "the datasheet's: torch's total not seen" in h200.describe()


def test_an_mi300x_starts_from_its_rocminfo_pool_less_a_rocm_context():
    mi300x = find_device("MI300X", live=False)
    total = 201_310_208 * KIB  # ROCm/rocm-examples#187: rocminfo's "Size: 201310208(0xbffc000) KB"
    assert mi300x.total_bytes == total and "201310208" in mi300x.total_source
    assert mi300x.runtime.platform == "rocm" and mi300x.runtime.context_bytes == ROCM_CONTEXT == GIB
    assert usable(mi300x) == int((total - GIB) / 1.05) == 195_302_772_540  # 181.89 GiB (168.9 before)


def test_fragmentation_is_a_share_of_the_peak_not_of_the_card():
    h100 = find_device("H100", live=False)
    peak = usable(h100)
    # the largest peak that fits leaves exactly its 5 % and the context of the total (to a byte of rounding)
    assert 0 <= h100.total - (peak + FRAGMENTATION * peak + CUDA_CONTEXT) < 1.05 + 1e-6
    small = sized_device("2GiB")
    assert usable(small) == int((2 * GIB - 768 * MIB) / 1.05)  # 5 % of the peak, not of the 2 GiB
    assert usable(sized_device("512MiB")) == 0  # less than the context: nothing left for a step


def test_the_models_figures_for_the_device_check():
    figures = headroom_figures(find_device("MI300X", live=False))
    assert figures["total_bytes"] == 201_310_208 * KIB and "rocminfo" in figures["total_source"]
    assert figures["context_bytes"] == GIB and figures["workspace_bytes"] == 2 * 204 * MIB
    assert figures["fragmentation"] == 0.05 and figures["usable_bytes"] == 195_302_772_540
    assert figures["workspaces"].startswith("gfx942: 2 x 204.0 MiB BLAS workspaces")


def test_collective_buffers_come_off_before_the_fragmentation_share():
    h100 = find_device("H100", live=False)
    assert usable(h100, NCCL_PER_RANK) == int((h100.total - 768 * MIB - NCCL_PER_RANK) / 1.05)


def test_every_card_says_where_its_total_comes_from():
    for card in CATALOGUE:
        assert card.isa, card.name
        if card.reported_memory is None:
            assert "datasheet's figure stands in" in card.reported_source, card.name
        else:
            assert "https://github.com/" in card.reported_source, card.name
            # the total sits within 8 % of the datasheet's either way (an H100 NVL's 94 GB is 87.5 GiB, torch 93.00)
            assert 0.9 < card.reported_memory / card.memory_bytes < 1.08, card.name
    t4 = find_device("T4", live=False)
    assert t4.total_bytes == round(14.75 * GIB) < t4.memory_bytes  # the decimal reading was not the safe side


# --------------------------------------------------------------------------- the GPU this process runs on


def _simulate_gpu(monkeypatch, name, free, total, hip=None, **props):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(**props))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.version, "hip", hip)


def test_the_gpu_this_process_runs_on_is_judged_by_what_is_free_now(monkeypatch):
    total, free = round(79.11 * GIB), round(78.5 * GIB)
    _simulate_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", free, total, major=9, minor=0, multi_processor_count=132)
    here = find_device("h100")
    assert here.live and here.card is not None and here.card.name == "H100 80GB"
    assert (here.total_bytes, here.free_bytes) == (total, free)
    assert here.runtime.isa == "sm_90" and here.runtime.workspace_bytes == 32 * MIB
    assert usable(here) == int(free / 1.05)  # its context is already out of the free memory: none kept again
    assert "free now (mem_get_info)" in here.describe()
    # the table's entry on demand, and another card is the table's
    assert not find_device("h100", live=False).live and usable(find_device("h100", live=False)) != usable(here)
    assert not find_device("H200").live


def test_a_rocm_gpu_here_has_rocms_workspaces(monkeypatch):
    total = 201_310_208 * KIB
    _simulate_gpu(
        monkeypatch,
        "AMD Instinct MI300X",
        total - 2 * GIB,
        total,
        hip="6.2.0",
        gcnArchName="gfx942:sramecc+:xnack-",
        multi_processor_count=304,
    )
    here = this_gpu(env={})
    assert here.live and here.card.name == "MI300X" and here.runtime.platform == "rocm"
    assert here.runtime.isa == "gfx942" and here.runtime.workspace_bytes == (128 + 76) * MIB
    assert here.runtime.comm == "RCCL" and here.runtime.comm_bytes == RCCL_BYTES


def test_no_gpu_here_means_the_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert this_gpu() is None and not find_device("h100").live


# --------------------------------------------------------------------------- the prediction's terms


def test_a_gpus_prediction_counts_its_blas_workspaces_as_a_term_and_the_cpus_does_not():
    config = make_config()
    raw = _peak(100 * MIB)
    cuda = with_runtime(raw, config, runtime_for("cuda", "sm_90", env={}))
    assert cuda.breakdown[BLAS_TERM] == 2 * 32 * MIB and cuda.peak_bytes == 100 * MIB + 64 * MIB
    assert cuda.comm_bytes == 0 and any("BLAS workspaces" in n for n in cuda.notes)
    a100 = with_runtime(raw, config, runtime_for("cuda", "sm_80", env={}))
    assert a100.breakdown[BLAS_TERM] == 2 * (8 * MIB + 128 * KIB)  # :4096:2:16:8 before Hopper
    rocm = with_runtime(raw, config, runtime_for("rocm", "gfx942", env={}))
    assert rocm.breakdown[BLAS_TERM] == 2 * (128 + 76) * MIB  # hipBLAS and hipBLASLt, per pair
    assert with_runtime(raw, config, None) is raw  # the CPU: nothing added
    assert with_runtime(cuda, config, runtime_for("cuda", "sm_90", env={})) is cuda  # never twice
    unpredictable = Prediction(None, error="x")
    assert with_runtime(unpredictable, config, runtime_for("cuda", "sm_90")) is unpredictable


@pytest.mark.parametrize(
    "platform, isa, env, each",
    [
        ("cuda", "sm_90", {"CUBLAS_WORKSPACE_CONFIG": ":4096:2"}, 8 * MIB),
        ("cuda", "sm_90", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8:16:8"}, 32 * MIB + 128 * KIB),
        ("cuda", "sm_90", {"CUBLAS_WORKSPACE_CONFIG": "garbled"}, 32 * MIB),  # torch warns and keeps its default
        ("cuda", "sm_90", {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, 33 * MIB),  # cuBLASLt's own 1 MiB
        ("cuda", "sm_100", {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}, 36 * MIB),
        ("cuda", "", {}, 32 * MIB),  # architecture not known: the newest cards' default
        ("rocm", "gfx90a", {}, (32 + 76) * MIB),
        ("rocm", "gfx942", {"HIPBLASLT_WORKSPACE_SIZE": "1024", "HIPBLAS_WORKSPACE_CONFIG": ":1024:1"}, 2 * MIB),
    ],
)
def test_the_workspace_follows_torchs_defaults_and_variables(platform, isa, env, each):
    assert runtime_for(platform, isa, env).workspace_bytes == each


def test_workspace_config_parses_as_torch_does():
    assert workspace_config(":4096:2:16:8") == 4096 * KIB * 2 + 16 * KIB * 8
    assert workspace_config(None) is None and workspace_config(":x:2") is None


def test_a_two_rank_cell_gets_an_nccl_allowance_beside_its_peak(monkeypatch):
    config = make_config(world_size=2)
    cuda = with_runtime(_peak(GIB), config, runtime_for("cuda", "sm_90", env={}))
    assert cuda.comm_bytes == NCCL_PER_RANK == 616_562_688  # 588 MiB
    assert cuda.peak_bytes == GIB + 64 * MIB  # not in the peak
    assert with_runtime(_peak(GIB), config, runtime_for("rocm", "gfx942", env={})).comm_bytes == GIB
    assert runtime_for("cuda", "sm_90", {"NCCL_MAX_NCHANNELS": "8"}).comm_bytes == NCCL_PER_RANK // 4
    one = with_runtime(_peak(GIB), make_config(), runtime_for("cuda", "sm_90", env={}))
    assert one.comm_bytes == 0


def test_the_verdict_keeps_the_nccl_buffers_off_what_the_peak_may_reach():
    h100 = find_device("H100", live=False)
    room = usable(h100)
    peak = room - 64 * MIB - 100 * MIB  # fits alone, not with 588 MiB of NCCL buffers beside it

    def predict(config, device_type, allow_imports=False):
        return _peak(peak)

    lines: list[str] = []
    single = fit_cells([make_config()], h100, "cuda", predictor=Predictor("cuda", predict, runtime=h100.runtime))
    predictor = Predictor("cuda", predict, runtime=h100.runtime)
    double = fit_cells([make_config(world_size=2)], h100, "cuda", predictor=predictor, talk=lines.append)
    assert single.cells[0].outcome == FITS
    assert double.cells[0].verdict.prediction.comm_bytes == NCCL_PER_RANK
    assert double.cells[0].verdict.outcome != FITS
    beside = [line for line in lines if "beside the peak: NCCL buffers" in line]
    assert len(beside) == 1 and "0.57 GiB per rank" in beside[0] and "NVIDIA/nccl#964" in beside[0]
    usable_line = f"{(usable(h100, NCCL_PER_RANK)) / GIB:.2f} GiB usable"
    assert any(usable_line in line for line in double.lines)


def test_judge_takes_a_fixed_budget_or_a_devices_figure_per_prediction():
    def predict(config, device_type, allow_imports=False):
        return _peak(1000)

    predictor = Predictor("cuda", predict)
    assert judge(make_config(), 1000, predictor).outcome == FITS
    assert judge(make_config(), lambda p: 999, predictor).outcome == NO_FIT


def test_the_fit_of_a_tiny_cell_on_an_h100_counts_the_workspaces_in_its_peak():
    config = make_config(
        pair={"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        overrides={"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 1}},
        method="forward_kl",
        batch_size=2,
        data={"kind": "tokens", "seq_len": 64},
    )
    bare = fit_cells([config], None, "cuda")
    h100 = fit_cells([config], find_device("H100", live=False), "cuda")
    plain, counted = bare.cells[0].prediction, h100.cells[0].prediction
    assert BLAS_TERM not in plain.breakdown and "BLAS workspaces not in the peaks" in bare.lines[1]
    assert counted.peak_bytes == plain.peak_bytes + 64 * MIB and counted.breakdown[BLAS_TERM] == 64 * MIB
    assert f"{BLAS_TERM} 0.06" in h100.text() and h100.cells[0].outcome == FITS
    record = h100.record()["device"]
    assert record["total_bytes"] == round(79.11 * GIB) and record["usable_bytes"] == usable(find_device("H100"))
    assert "768 MiB CUDA context kept" in record["headroom"]


# --------------------------------------------------------------------------- the step rows (run time)


def test_a_step_row_on_a_gpu_is_predicted_with_that_gpus_workspaces(monkeypatch):
    monkeypatch.setattr(planner, "predict", lambda config, device_type, allow_imports=False, **_: _peak(100 * MIB))
    _simulate_gpu(monkeypatch, "NVIDIA H200", 130 * GIB, 140 * GIB, major=9, minor=0, multi_processor_count=132)
    gpu = prediction_of(make_config(), "cuda")
    assert gpu.breakdown[BLAS_TERM] == 64 * MIB and gpu.peak_bytes == 164 * MIB
    columns, _ = fit_columns(gpu, 170 * MIB)
    assert columns["predicted_peak_bytes"] == 164 * MIB
    assert '"blas workspaces": 67108864' in columns["predicted_breakdown"]
    assert columns["predicted_peak_ratio"] == pytest.approx(170 / 164)
    cpu = prediction_of(make_config(), "cpu")
    assert BLAS_TERM not in cpu.breakdown and cpu.peak_bytes == 100 * MIB
