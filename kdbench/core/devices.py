"""The device catalogue: each accelerator kdbench knows, with its datasheet figures and the source of each, and the
one name matcher that finds a card by what a user writes or by what torch reports.

One table for the two readers that used to keep their own: the store computes utilisation against a card's dense
peak at read time (:func:`datasheet_peak`, :mod:`kdbench.store.derived`), and the fit planner judges a step
against a card's memory (:mod:`kdbench.fit.devices`, which keeps the headroom model).  Pure data and string
matching, no torch, on the base floor.

Each :class:`Card` is one torch device (a rank's): its memory, its dense peak per precision, its memory bandwidth,
its interconnect bandwidth where the datasheet gives one, and its full count of compute units, each figure with
its source in :attr:`Card.sources`.  Conventions:

* Memory: a datasheet's "80GB" is read as 80 x 10^9 bytes (:attr:`Card.memory_bytes`).  What torch reports as the
  device's total (``get_device_properties().total_memory``, the same figure as ``mem_get_info``'s total) is another
  figure, neither the datasheet's nor nvidia-smi's: :attr:`Card.reported_memory`, from a print found in a public
  issue (:attr:`Card.reported_source` quotes it), or None where none was found, the datasheet's figure then standing
  in.  The two differ both ways: an H100 80GB reports 79.11 GiB (the datasheet's 80 GB is 74.51 GiB), a T4 14.75 GiB
  (its 16 GB is 14.90 GiB).  The fit's headroom (:mod:`kdbench.fit.devices`) starts from the reported figure.
* Peaks, dense TFLOP/s (sparsity figures halved back to dense).  tf32 is the TF32 tensor-core figure (XF32 on
  MI300X; None where the device has no such mode).  fp16/bf16 are the matrix (Tensor Core / Matrix Core) figures.
  fp32 is the plain, non-tensor FP32 figure: on NVIDIA the non-Tensor-Core number (torch's fp32 matmul does not
  use TF32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set); on AMD CDNA the "FP32 vector" number.
  Caveat: on CDNA2 (MI200) the datasheet's "FP32 matrix" figure is twice the vector one, and rocBLAS/hipBLASLt
  fp32 GEMMs run on the matrix cores, so a measured fp32 matmul there can exceed this peak (up to 2x).  On MI300X
  the matrix and vector FP32 figures are equal.
* Memory bandwidth: the datasheet's peak, GB/s (10^9 bytes per second).
* Interconnect: the datasheet's GPU-to-GPU bandwidth, GB/s, both directions together, of the fastest link it
  lists (NVLink, Infinity Fabric; PCIe where the card has nothing else); None where no per-device figure is
  published.
* A card that torch shows as several devices (an MI250X's two GCDs) holds one device's share: a rank's.

Names.  A card is found (:func:`find_card`) by its name or an alias as a user writes it (case, spaces, dashes and
underscores ignored: ``h100``, ``H100-80GB``), by the whole name ``torch.cuda.get_device_name`` reports
(:attr:`Card.reported`, lower case, spaces collapsed), or, where ROCm's name is empty or generic, by the
architecture and compute-unit count (:attr:`Card.archs`).  Whole-name matching keeps variants with other figures
(MI300A, H200 NVL, A10, A100X ...) from borrowing a sibling's peak.  The H100 NVL and the MI325X are in the
catalogue by their user names only: what torch reports on them has not been seen here, so a stored row measured
on one gets no datasheet peak yet (add the name to ``reported`` once it has).

torch's own table (``torch/_inductor/analysis/device_info.py``, torch 2.14: ``DeviceInfo`` with ``tops``,
``dram_bw_gbs``, ``dram_gb``) is not imported (it imports torch; this module is torch-free).  Where it agrees:
MI300X (FP32 163.4, TF32 653.7, FP16/BF16 1307.4 TFLOP/s, 5,300 GB/s, 192 GB); H100 SXM (FP32 67, and its
sparse TF32 989 and BF16 1979 halved by its ``tops_sparsity_factor`` to 494.5 and 989.5: the whitepaper's dense
494.7 and 989.4 here; 3,350 GB/s; 80 GB); A100 (FP32 19.5, TF32 156, 2,039 GB/s and 80 GB: the A100 80GB SXM;
its BF16 312.5 is the datasheet's 312 here); the MI210's BF16/FP16 181, 1,600 GB/s and 64 GB.  Where it is not
taken: its L4 TF32 120 and BF16 242 are the datasheet's sparse figures read as dense (no sparsity factor; 60 and
121 here), and its L4 bandwidth, 3,350 GB/s, is the H100's (the L4 datasheet: 300 GB/s); its MI210 FP32 45.3 is
the FP32 *matrix* figure and its TF32 copies it, where this table keeps the FP32 vector 22.6 and no TF32 (CDNA2
has none).  Its keys are exact upper-cased names ("NVIDIA H100", "NVIDIA A100", "AMD MI210X") that are not what
torch reports on those cards ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI210"), so it
finds fewer of them; its MI300A, MI350X and Intel entries are not in this catalogue.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from kdbench.core.errors import KdbenchError
from kdbench.core.names import PRECISIONS
from kdbench.core.sizes import GB

FIGURES = ("memory", "peaks", "memory_bandwidth", "interconnect", "compute_units")  # each with a source


@dataclass(frozen=True)
class Card:
    """One accelerator as torch shows it (one device: a rank's), with the source of each figure."""

    name: str  # what --gpu takes and the fit prints ("H100 80GB")
    part: str  # the name its peaks go by (the datasheet_device column): cards with the same compute share it
    memory_bytes: int
    peaks: Mapping[str, float | None]  # dense TFLOP/s by precision (PRECISIONS); None: the device lacks the mode
    memory_bandwidth: float  # GB/s
    interconnect: float | None  # GB/s, GPU to GPU, both directions; None: no per-device figure published
    compute_units: int  # the full chip's CUs (AMD) or SMs (NVIDIA) behind the peaks
    sources: Mapping[str, str]  # each of FIGURES -> the datasheet (name and address) that states it
    note: str = ""
    aliases: tuple[str, ...] = ()  # other names a user may write
    reported: str = ""  # the whole names torch reports (a regex, lower case, spaces collapsed); "": none matched
    archs: tuple[tuple[str, int | None], ...] = field(default=())  # (gfx architecture, CUs or None: any)
    isa: str = ""  # the instruction set torch reports ("sm_90", "gfx942"): picks the BLAS libraries' workspaces
    reported_memory: int | None = None  # the total torch reports (total_memory, mem_get_info's total); None: not seen
    reported_source: str = ""  # where that total was printed, or why the datasheet's figure is kept

    @property
    def price(self) -> float | None:
        """On-demand US dollars per device-hour (:data:`PRICES`); None where no public price was found."""
        return PRICES.get(self.name, (None, ""))[0]

    @property
    def price_source(self) -> str:
        return PRICES.get(self.name, (None, "no public price found"))[1]


def _peaks(fp32: float, tf32: float | None, fp16: float, bf16: float | None) -> dict[str, float | None]:
    return {"fp32": fp32, "tf32": tf32, "fp16": fp16, "bf16": bf16}


_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_H100_PAPER = "and the NVIDIA H100 Tensor Core GPU Architecture whitepaper"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/tesla-t4/"
_MI300X = "AMD Instinct MI300X accelerator data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
_MI325X = "AMD Instinct MI325X accelerator data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html"
_MI250X = "AMD Instinct MI250X accelerator data sheet, https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html"
_MI210 = (
    "AMD Instinct MI210 accelerator data sheet, https://www.amd.com/en/products/accelerators/instinct/mi200/mi210.html"
)

_GIB = 2**30
_NOT_SEEN = (
    "no print of the total torch reports was found for this card: the datasheet's figure stands in (on the cards "
    "where both were seen, torch reports 0.25-0.6 GiB less than nvidia-smi's total)"
)
_GFX90A = (
    "ROCm/TheRock#1395, rocminfo on a gfx90a device (an MI210 or one MI250X GCD, both 64 GB of HBM2e): its global "
    "pool 'Size: 67092480(0x3ffc000) KB' (64 GiB less 16 MiB; the HIP runtime's total), "
    "https://github.com/ROCm/TheRock/issues/1395"
)

CATALOGUE: tuple[Card, ...] = (
    Card(
        "H100 80GB",
        "H100 SXM",
        80 * GB,
        _peaks(67.0, 494.7, 989.4, 989.4),
        3350.0,
        900.0,
        132,
        {
            "memory": f"{_H100} (H100 SXM: 80 GB HBM3)",
            "peaks": f"{_H100} {_H100_PAPER} (SXM5): FP32 67, TF32 494.7 and FP16/BF16 989.4 dense (989 / 1,979 "
            "with sparsity)",
            "memory_bandwidth": f"{_H100} (H100 SXM: 3.35 TB/s)",
            "interconnect": f"{_H100} (H100 SXM: NVLink 900 GB/s)",
            "compute_units": f"{_H100} {_H100_PAPER} (H100 SXM5: 132 SMs)",
        },
        aliases=("h100", "h100 sxm"),
        reported=r"nvidia h100( sxm5?)? 80gb hbm3",
        isa="sm_90",
        reported_memory=round(79.11 * _GIB),
        reported_source="vllm-project/vllm#27508, torch's out-of-memory message on an H100 80GB: 'GPU 0 has a total "
        "capacity of 79.11 GiB' (nvidia-smi shows 81559MiB: modal-labs/modal-client#2797), "
        "https://github.com/vllm-project/vllm/issues/27508",
    ),
    Card(
        "H100 NVL",
        "H100 NVL",
        94 * GB,
        _peaks(60.0, 417.5, 835.5, 835.5),
        3900.0,
        600.0,
        132,
        {
            "memory": f"{_H100} (H100 NVL: 94 GB HBM3)",
            "peaks": f"{_H100} (H100 NVL: FP32 60, TF32 835 and FP16/BF16 1,671 with sparsity)",
            "memory_bandwidth": f"{_H100} (H100 NVL: 3.9 TB/s)",
            "interconnect": f"{_H100} (H100 NVL: NVLink 600 GB/s)",
            "compute_units": f"{_H100} (H100 NVL: the full GH100 configuration of H100 SXM, 132 SMs)",
        },
        aliases=("h100 94gb",),  # "h100nvl" is its name without the space
        isa="sm_90",
        reported_memory=round(93.00 * _GIB),
        reported_source="ali-vilab/VACE#56, torch's out-of-memory message on an H100 NVL 94GB: 'GPU 0 has a total "
        "capacity of 93.00 GiB', https://github.com/ali-vilab/VACE/issues/56",
    ),
    Card(
        "H200",
        "H200 SXM",
        141 * GB,
        _peaks(67.0, 494.7, 989.4, 989.4),
        4800.0,
        900.0,
        132,
        {
            "memory": f"{_H200} (141 GB HBM3e)",
            "peaks": f"{_H200} (H200 SXM: FP32 67, TF32 989 and FP16/BF16 1,979 with sparsity; the GH100 SXM5 "
            "compute of H100 SXM, whose dense figures are 494.7 and 989.4)",
            "memory_bandwidth": f"{_H200} (4.8 TB/s)",
            "interconnect": f"{_H200} (H200 SXM: NVLink 900 GB/s)",
            "compute_units": f"{_H200} (the GH100 SXM5 of H100 SXM: 132 SMs)",
        },
        aliases=("h200 141gb", "h200 sxm"),
        reported=r"nvidia h200",
        isa="sm_90",
        reported_source=_NOT_SEEN,
    ),
    Card(
        "A100 40GB",
        "A100",
        40 * GB,
        _peaks(19.5, 156.0, 312.0, 312.0),
        1555.0,
        600.0,
        108,
        {
            "memory": f"{_A100} (A100 40GB: 40 GB HBM2)",
            "peaks": f"{_A100} (FP32 19.5, TF32 156 (312 sparse), FP16/BF16 312 (624 sparse); the same for 40GB "
            "and 80GB, PCIe and SXM)",
            "memory_bandwidth": f"{_A100} (A100 40GB: 1,555 GB/s)",
            "interconnect": f"{_A100} (NVLink 600 GB/s; PCIe cards through an NVLink bridge of two)",
            "compute_units": f"{_A100} and the NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs)",
        },
        aliases=("a100 40",),
        reported=r"nvidia a100-(sxm4|pcie)-40gb",
        isa="sm_80",
        reported_memory=42_298_834_944,
        reported_source="bottlerocket-os/bottlerocket#3873, deviceQuery on an NVIDIA A100-SXM4-40GB: 'Total amount of "
        "global memory: 40339 MBytes (42298834944 bytes)', https://github.com/bottlerocket-os/bottlerocket/pull/3873",
    ),
    Card(
        "A100 80GB",
        "A100",
        80 * GB,
        _peaks(19.5, 156.0, 312.0, 312.0),
        2039.0,
        600.0,
        108,
        {
            "memory": f"{_A100} (A100 80GB: 80 GB HBM2e)",
            "peaks": f"{_A100} (FP32 19.5, TF32 156 (312 sparse), FP16/BF16 312 (624 sparse); the same for 40GB "
            "and 80GB, PCIe and SXM)",
            "memory_bandwidth": f"{_A100} (A100 80GB SXM: 2,039 GB/s; the 80GB PCIe card: 1,935 GB/s)",
            "interconnect": f"{_A100} (NVLink 600 GB/s; PCIe cards through an NVLink bridge of two)",
            "compute_units": f"{_A100} and the NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs)",
        },
        aliases=("a100", "a100 80"),
        reported=r"nvidia a100-(sxm4|pcie)-80gb|nvidia a100 80gb pcie",
        isa="sm_80",
        reported_memory=81049 * 2**20,
        reported_source="ekondis/mixbench#47, an NVIDIA A100 80GB PCIe: 'Total global mem: 81049 MB' (totalGlobalMem "
        "/ 1024 / 1024, floored), https://github.com/ekondis/mixbench/issues/47",
    ),
    Card(
        "H100 PCIe",
        "H100 PCIe",
        80 * GB,
        _peaks(51.0, 378.0, 756.0, 756.0),
        2000.0,
        600.0,
        114,
        {
            "memory": f"{_H100} (H100 PCIe: 80 GB HBM2e)",
            "peaks": f"{_H100} {_H100_PAPER} (H100 PCIe: FP32 51, TF32 378 and FP16/BF16 756 dense; 756 / 1,513 "
            "sparse)",
            "memory_bandwidth": f"{_H100} (H100 PCIe: 2 TB/s)",
            "interconnect": f"{_H100} (H100 PCIe: NVLink bridge 600 GB/s)",
            "compute_units": f"{_H100} {_H100_PAPER} (H100 PCIe: 114 SMs)",
        },
        reported=r"nvidia h100 pcie",
        isa="sm_90",
        reported_source=_NOT_SEEN,
    ),
    Card(
        "L4",
        "L4",
        24 * GB,
        _peaks(30.3, 60.0, 121.0, 121.0),
        300.0,
        64.0,
        58,
        {
            "memory": f"{_L4} (24 GB GDDR6)",
            "peaks": f"{_L4} (FP32 30.3, TF32 120 and FP16/BF16 242 with sparsity -> 60 and 121)",
            "memory_bandwidth": f"{_L4} (300 GB/s)",
            "interconnect": f"{_L4} (no NVLink: PCIe Gen4 x16, 64 GB/s)",
            "compute_units": f"{_L4} and the NVIDIA Ada GPU Architecture whitepaper (AD104 as L4: 58 SMs)",
        },
        reported=r"nvidia l4",
        isa="sm_89",
        reported_source=f"{_NOT_SEEN}; nvidia-smi shows 23034MiB (modal-labs/modal-client#2797), so torch likely "
        "reports about 22.0 GiB, below the datasheet's 22.35",
    ),
    Card(
        "T4",
        "T4",
        16 * GB,
        _peaks(8.1, None, 65.0, None),
        320.0,
        32.0,
        40,
        {
            "memory": f"{_T4} (16 GB GDDR6)",
            "peaks": f"{_T4} (FP32 8.1, mixed-precision FP16 65; Turing has no bf16 or TF32)",
            "memory_bandwidth": f"{_T4} (320+ GB/s)",
            "interconnect": f"{_T4} (no NVLink: PCIe Gen3 x16, 32 GB/s)",
            "compute_units": f"{_T4} and the NVIDIA Turing GPU Architecture whitepaper (TU104 as T4: 40 SMs)",
        },
        reported=r"(tesla|nvidia) t4",
        isa="sm_75",
        reported_memory=round(14.75 * _GIB),
        reported_source="hpcaitech/Open-Sora#697, torch's out-of-memory message on a Google Colab T4: 'GPU 0 has a "
        "total capacity of 14.75 GiB', https://github.com/hpcaitech/Open-Sora/issues/697",
    ),
    Card(
        "MI300X",
        "MI300X",
        192 * GB,
        _peaks(163.4, 653.7, 1307.4, 1307.4),
        5300.0,
        896.0,
        304,
        {
            "memory": f"{_MI300X} (192 GB HBM3)",
            "peaks": f"{_MI300X} (FP32 vector 163.4, TF32 653.7 (1307.4 with sparsity), FP16 and BF16 1307.4 "
            "(2614.9 with sparsity))",
            "memory_bandwidth": f"{_MI300X} (5.3 TB/s)",
            "interconnect": f"{_MI300X} (7 Infinity Fabric links of 128 GB/s: 896 GB/s)",
            "compute_units": f"{_MI300X} (304 CUs)",
        },
        note="an MI300X in CPX or DPX compute-partition mode shows 38 or 152 of its 304 CUs under the full card's "
        "name: its peak is scaled to its share",
        reported=r"amd instinct mi300x( vf)?",
        archs=(("gfx942", None),),  # an MI325X with an empty name shares MI300X's compute and peaks
        isa="gfx942",
        reported_memory=201_310_208 * 1024,
        reported_source="ROCm/rocm-examples#187, rocminfo on an MI300X (gfx942): its global pool 'Size: "
        "201310208(0xbffc000) KB' (192 GiB less 16 MiB; the HIP runtime's total), "
        "https://github.com/ROCm/rocm-examples/issues/187",
    ),
    Card(
        "MI325X",
        "MI325X",
        256 * GB,
        _peaks(163.4, 653.7, 1307.4, 1307.4),
        6000.0,
        896.0,
        304,
        {
            "memory": f"{_MI325X} (256 GB HBM3E)",
            "peaks": f"{_MI325X} (FP32 vector 163.4, TF32 653.7, FP16 and BF16 1307.4 (2614.9 with sparsity): "
            "MI300X's compute)",
            "memory_bandwidth": f"{_MI325X} (6 TB/s)",
            "interconnect": f"{_MI325X} (7 Infinity Fabric links of 128 GB/s: 896 GB/s)",
            "compute_units": f"{_MI325X} (304 CUs)",
        },
        isa="gfx942",
        reported_source=_NOT_SEEN,
    ),
    Card(
        "MI250X",
        "MI250X (per GCD)",
        64 * GB,
        _peaks(47.9 / 2, None, 383.0 / 2, 383.0 / 2),
        3276.8 / 2,
        None,
        110,
        {
            "memory": f"{_MI250X} (128 GB HBM2e on the package)",
            "peaks": f"{_MI250X} (whole card, 2 GCDs: FP32 vector 47.9, FP16/BF16 383.0; CDNA2 has no TF32/XF32), "
            "halved",
            "memory_bandwidth": f"{_MI250X} (whole card: 3.2 TB/s), halved",
            "interconnect": f"{_MI250X} (up to 800 GB/s of Infinity Fabric for the package, its two GCDs and the "
            "links between them together: no per-GCD figure)",
            "compute_units": f"{_MI250X} (220 CUs on the package, 110 per GCD)",
        },
        note="one GCD: an MI250X is two graphics compute dies of 64 GB each, and ROCm shows each as a device, so a "
        "rank gets 64 GB and half the card's peaks; torch names MI250 and MI250X alike ('MI250X/MI250'), and an "
        "MI250 (45.3 / 362.1 TFLOP/s) is ~5% slower",
        aliases=("mi250x gcd",),
        reported=r"amd instinct mi250x(/mi250)?",
        archs=(("gfx90a", 110),),
        isa="gfx90a",
        reported_memory=67_092_480 * 1024,
        reported_source=_GFX90A,
    ),
    Card(
        "MI210",
        "MI210",
        64 * GB,
        _peaks(22.6, None, 181.0, 181.0),
        1638.4,
        300.0,
        104,
        {
            "memory": f"{_MI210} (64 GB HBM2e)",
            "peaks": f"{_MI210} (FP32 vector 22.6, FP16/BF16 181.0; CDNA2 has no TF32/XF32)",
            "memory_bandwidth": f"{_MI210} (1.6 TB/s)",
            "interconnect": f"{_MI210} (Infinity Fabric Link bridge: up to 300 GB/s)",
            "compute_units": f"{_MI210} (104 CUs)",
        },
        reported=r"amd instinct mi210",
        archs=(("gfx90a", 104),),
        isa="gfx90a",
        reported_memory=67_092_480 * 1024,
        reported_source=_GFX90A,
    ),
)


# --- prices -------------------------------------------------------------------------------------------------------
# On-demand US dollars per device-hour (one rank's device: a GPU), what `kdbench fit --tokens/--steps` multiplies
# device-hours by; `--price` overrides it.  One published table for all of them, so that the cards compare at one
# kind of price: cloud-gpus.com's (github.com/cloud-gpus/cloud-gpus.github.io, cloud_gpu.json at commit 61a3021 of
# 2025-09-17, each provider's price with its page), read 2026-12-06.  One provider where it lists the card, so that
# H100, H200, A100 and MI300X compare at one provider's prices: Crusoe Cloud's on-demand list (set in that table on
# 2025-05-29, commit 7c9af4f, unchanged since).  A card Crusoe does not list: the provider named.  Prices move (AWS
# cut its P5 prices by up to 45 % in June 2025; neoclouds list H100s from under $2 to over $6): the figure is an
# example at a date, for ranking devices, and `--price` is for the user's own.
_PRICE_TABLE = (
    "cloud-gpus.com's table (cloud-gpus/cloud-gpus.github.io, cloud_gpu.json at 61a3021, 2025-09-17), read 2026-12-06"
)
_CRUSOE = f"Crusoe Cloud on demand, https://crusoecloud.com/pricing/, as {_PRICE_TABLE}"
PRICES: dict[str, tuple[float | None, str]] = {
    "H100 80GB": (3.90, f"{_CRUSOE}: H100 80GB (HGX SXM) $3.90 per GPU-hour"),
    "H200": (4.29, f"{_CRUSOE}: H200 141GB $4.29 per GPU-hour"),
    "A100 40GB": (1.45, f"{_CRUSOE}: A100 40GB $1.45 per GPU-hour"),
    "A100 80GB": (1.65, f"{_CRUSOE}: A100 80GB $1.65 per GPU-hour"),
    "MI300X": (3.45, f"{_CRUSOE}: MI300X 192GB $3.45 per GPU-hour"),
    "MI325X": (4.62, f"Vultr on demand (Crusoe lists none), as {_PRICE_TABLE}: MI325X $4.62 per GPU-hour"),
    "L4": (
        0.71,
        f"Google Cloud on demand, https://cloud.google.com/compute/gpus-pricing (Crusoe lists none), as "
        f"{_PRICE_TABLE}: L4 $0.71 per hour (a g2-standard-4 with one L4, set in that table 2023-10-05)",
    ),
    "T4": (
        0.53,
        f"AWS on demand (Crusoe lists none), as {_PRICE_TABLE}: T4 $0.53 per hour (g4dn.xlarge, one T4, us-east-1; "
        "set in that table 2023-10-05)",
    ),
    "H100 NVL": (None, f"no price: {_PRICE_TABLE} has one H100 column, which does not say SXM, PCIe or NVL"),
    "H100 PCIe": (None, f"no price: {_PRICE_TABLE} has one H100 column, which does not say SXM, PCIe or NVL"),
    "MI250X": (
        None,
        f"no price: {_PRICE_TABLE} lists an MI250X at Cirrascale ($1.60/h) without saying whether it is the card "
        "(two GCDs) or one GCD, this table's device",
    ),
    "MI210": (None, f"no price: {_PRICE_TABLE} lists no MI210"),
}


def name_key(name: str) -> str:
    """A name as a user writes it, looked up: case, spaces, dashes and underscores ignored."""
    return re.sub(r"[\s_\-]+", "", name).lower()


def _user_names() -> dict[str, Card]:
    return {name_key(alias): card for card in CATALOGUE for alias in (card.name, *card.aliases)}


_BY_KEY = _user_names()


def find_card(name: str, units: int | None = None, arch: str | None = None) -> Card | None:
    """The catalogue's card called ``name``: its name or an alias as a user writes it, or the whole name torch
    reports; where neither matches, the ROCm architecture ``arch`` (``gfx942:sramecc+:xnack-``) with the compute
    units torch sees (``units``).  None for CPUs and devices the catalogue lacks."""
    card = _BY_KEY.get(name_key(name))
    if card is not None:
        return card
    reported = " ".join(name.lower().split())
    card = next((c for c in CATALOGUE if c.reported and re.fullmatch(c.reported, reported)), None)
    if card is None and arch:
        gfx = arch.split(":")[0]
        card = next((c for c in CATALOGUE for a, cus in c.archs if a == gfx and cus in (None, units)), None)
    return card


def datasheet_peak(
    device_name: str, dtype: str, units: int | None = None, arch: str | None = None
) -> tuple[str, float] | None:
    """(part, dense peak TFLOP/s) for a GPU as torch reports it; None for CPUs, unknown devices, and dtypes the
    device lacks.  ``units`` (compute units torch sees) scales the peak of a partitioned device (an MI300X in CPX
    mode); ``arch`` names the part where the name does not."""
    if dtype not in PRECISIONS:
        raise KdbenchError(f"unknown dtype '{dtype}'; use {', '.join(PRECISIONS)}")
    card = find_card(device_name, units, arch)
    if card is None or card.peaks[dtype] is None:
        return None
    peak, full = card.peaks[dtype], card.compute_units
    if units and 0 < units < full:
        return f"{card.part} ({units} of {full} CUs)", peak * units / full
    return card.part, peak
