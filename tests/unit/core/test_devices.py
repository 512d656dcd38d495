"""The device catalogue (kdbench.core.devices): every card with each figure and its source, the peaks it held as
peaks.py, one matcher that finds the same card by what a user writes and by what torch reports, and where it agrees
with torch's own table."""

import subprocess
import sys

import pytest

from kdbench.core.devices import CATALOGUE, FIGURES, datasheet_peak, find_card, name_key
from kdbench.core.names import PRECISIONS
from kdbench.core.sizes import GB
from kdbench.fit.devices import find_device


def test_every_card_has_each_figure_with_a_datasheet_source():
    for card in CATALOGUE:
        assert set(card.sources) == set(FIGURES), card.name
        vendor = "https://www.nvidia.com/" if card.part[0] in "HALT" else "https://www.amd.com/"
        for figure in FIGURES:
            source = card.sources[figure]
            assert vendor in source and "data" in source.lower() and "sheet" in source.lower(), (card.name, figure)
        assert set(card.peaks) == set(PRECISIONS) and card.peaks["fp32"] > 0 and card.peaks["fp16"] > 0
        assert card.memory_bytes > 0 and card.memory_bandwidth > 0 and card.compute_units > 0
        # the source states the figure the card holds (a figure halved for one GCD: the package's, and says so)
        assert f"{card.memory_bytes // GB} GB" in card.sources["memory"] or "package" in card.sources["memory"]
        if card.interconnect is None:
            assert "no per-GCD figure" in card.sources["interconnect"]
        else:
            assert f"{card.interconnect:,.0f} GB/s" in card.sources["interconnect"], card.name


def test_the_peaks_are_those_peaks_py_held():
    peaks = {card.part: dict(card.peaks) for card in CATALOGUE if card.reported or card.archs}
    assert peaks == {
        "MI300X": {"fp32": 163.4, "tf32": 653.7, "fp16": 1307.4, "bf16": 1307.4},
        "MI250X (per GCD)": {"fp32": 47.9 / 2, "tf32": None, "fp16": 383.0 / 2, "bf16": 383.0 / 2},
        "MI210": {"fp32": 22.6, "tf32": None, "fp16": 181.0, "bf16": 181.0},
        "H200 SXM": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
        "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
        "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
        "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
        "L4": {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
        "T4": {"fp32": 8.1, "tf32": None, "fp16": 65.0, "bf16": None},
    }
    units = {card.part: card.compute_units for card in CATALOGUE}
    assert units["MI300X"] == 304 and units["MI250X (per GCD)"] == 110 and units["H100 PCIe"] == 114
    assert units["A100"] == 108 and units["L4"] == 58 and units["T4"] == 40


@pytest.mark.parametrize(
    "user, reported",
    [
        ("h100", "NVIDIA H100 80GB HBM3"),
        ("H100 PCIe", "NVIDIA H100 PCIe"),
        ("h200", "NVIDIA H200"),
        ("a100-40gb", "NVIDIA A100-SXM4-40GB"),
        ("A100", "NVIDIA A100-SXM4-80GB"),
        ("a100 80", "NVIDIA A100 80GB PCIe"),
        ("L4", "NVIDIA L4"),
        ("t4", "Tesla T4"),
        ("mi300x", "AMD Instinct MI300X VF"),
        ("MI250X", "AMD Instinct MI250X/MI250"),
        ("mi210", "AMD Instinct MI210"),
    ],
)
def test_the_fits_name_and_the_name_torch_reports_find_the_same_card(user, reported):
    card = find_card(reported)
    assert card is not None and find_device(user).card is card and find_card(user) is card
    assert datasheet_peak(reported, "fp16") == (card.part, card.peaks["fp16"])
    assert find_device(user).memory_bytes == card.memory_bytes


def test_the_a100s_share_their_peaks_under_one_part_and_differ_in_memory():
    small, large = find_card("NVIDIA A100-PCIE-40GB"), find_card("NVIDIA A100-SXM4-80GB")
    assert small.part == large.part == "A100" and small.peaks == large.peaks
    assert (small.memory_bytes, large.memory_bytes) == (40 * GB, 80 * GB)


def test_cards_matched_by_user_names_only_get_no_peak_from_what_torch_reports():
    # the H100 NVL and the MI325X: their torch names not seen yet, so a stored row measured on one gets no peak
    for user, reported in (("H100 NVL", "NVIDIA H100 NVL"), ("MI325X", "AMD Instinct MI325X")):
        assert find_card(user).name == user and find_card(reported) is None
        assert datasheet_peak(reported, "bf16") is None


def test_names_are_unique_across_the_catalogue():
    keys = [name_key(n) for card in CATALOGUE for n in (card.name, *card.aliases)]
    assert len(keys) == len(set(keys))
    assert len({card.name for card in CATALOGUE}) == len(CATALOGUE)


def test_the_catalogue_agrees_with_torchs_table_where_its_docstring_says_so():
    import torch
    from torch._inductor.analysis.device_info import lookup_device_info

    def dense(info, key):
        return info.tops[key] / info.tops_sparsity_factor

    mi300x, card = lookup_device_info("AMD Instinct MI300X"), find_card("MI300X")
    assert (dense(mi300x, torch.float32), dense(mi300x, "torch.tf32"), dense(mi300x, torch.bfloat16)) == (
        card.peaks["fp32"],
        card.peaks["tf32"],
        card.peaks["bf16"],
    )
    assert mi300x.dram_bw_gbs == card.memory_bandwidth and mi300x.dram_gb * GB == card.memory_bytes
    h100, card = lookup_device_info("NVIDIA H100"), find_card("H100 80GB")
    assert dense(h100, torch.bfloat16) == pytest.approx(card.peaks["bf16"], rel=1e-3)
    assert dense(h100, "torch.tf32") == pytest.approx(card.peaks["tf32"], rel=1e-3)
    assert h100.dram_bw_gbs == card.memory_bandwidth
    a100 = lookup_device_info("NVIDIA A100")
    assert a100.dram_bw_gbs == find_card("A100 80GB").memory_bandwidth and a100.dram_gb * GB == 80 * GB
    # not taken: torch's L4 tensor figures are the sparse ones (twice ours) and its bandwidth the H100's
    l4, card = lookup_device_info("NVIDIA L4"), find_card("L4")
    assert dense(l4, torch.bfloat16) == 2 * card.peaks["bf16"] and l4.dram_bw_gbs == 3350 != card.memory_bandwidth
    # nor its MI210 FP32 (the matrix figure, twice the vector one this table keeps)
    mi210 = lookup_device_info("AMD MI210X").tops[torch.float32]
    assert mi210 == pytest.approx(2 * find_card("MI210").peaks["fp32"], rel=0.01)
    # its keys are not the names torch reports on these cards
    assert lookup_device_info("NVIDIA H100 80GB HBM3") is None and lookup_device_info("AMD Instinct MI210") is None


def test_the_catalogue_is_torch_free():
    code = "import sys, kdbench.core.devices, kdbench.core.sizes, kdbench.core.registry, kdbench.core.limits\n"
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
