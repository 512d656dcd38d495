"""The devices a prediction is judged against: a table of named accelerators with their memory and the source of
each figure, ``cpu`` (this machine's memory), sizes as a user writes them (``141GB``, ``80GiB``), and the headroom
model that turns a device's memory into what a step may use.

Sizes: ``GB`` / ``TB`` are decimal (10^9, 10^12 bytes), ``GiB`` / ``TiB`` binary (2^30, 2^40), a bare number is
bytes.  A datasheet's "80GB" is read as 80 x 10^9 bytes, which is at most what the card holds: NVIDIA's and AMD's
HBM figures are the stacks' size, and torch reports somewhat more (a few GiB on an H100 or H200) than the decimal
figure; reading it as decimal keeps a verdict of ``fits`` on the safe side.

Headroom (:func:`usable`): a step cannot use all of a GPU's memory.  The runtime's own context (CUDA or ROCm
context, kernel images, cuBLAS/cuBLASLt/hipBLASLt and cuDNN/MIOpen workspaces) is taken as :data:`RUNTIME_CONTEXT`
(1 GiB), and of the rest a share :data:`FRAGMENTATION` (5 %) is kept for the caching allocator's rounding and
fragmentation.  Both are assumptions, stated here and in docs/fit.md, to be checked on a GPU: a CUDA 12 context
with lazy module loading is commonly reported at 0.3-0.6 GiB, cuBLAS's workspace at tens of MiB per stream, and the
allocator's waste at a few percent of the reserved memory; the figures are rounded up from those.  The CPU has
neither: its usable memory is what the operating system reports available now (``psutil``), which leaves out what
the OS and other processes keep.

Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kdbench.core.errors import KdbenchError, did_you_mean

GB, GIB = 10**9, 2**30
RUNTIME_CONTEXT = GIB  # a GPU runtime's own context and library workspaces (an assumption: see the module's notes)
FRAGMENTATION = 0.05  # the share of the rest kept for the caching allocator's rounding and fragmentation (assumed)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Device:
    """A device a cell's step runs on: its memory per device (one rank's), what kind it is, and where the figure
    comes from."""

    name: str
    memory_bytes: int
    kind: str  # "gpu" (the runtime context and fragmentation apply) or "cpu"
    source: str  # the vendor's datasheet (name and address), or how the figure was read
    note: str = ""
    aliases: tuple[str, ...] = ()
    available_bytes: int | None = None  # cpu: what the OS reports available (the usable figure)

    @property
    def usable_bytes(self) -> int:
        return usable(self)

    def describe(self) -> str:
        """One line: the device, its memory and what a step may use of it."""
        context = (
            f"{gib(RUNTIME_CONTEXT)} runtime context and {FRAGMENTATION:.0%} for fragmentation kept"
            if self.kind == "gpu"
            else "what the OS reports available"
        )
        return (
            f"{self.name}: {gib(self.memory_bytes)} ({self.memory_bytes / GB:g} GB), "
            f"usable {gib(self.usable_bytes)} per device ({context})"
        )


def usable(device: Device) -> int:
    """What one step may use of ``device``'s memory: a GPU's memory less the runtime's context, less
    :data:`FRAGMENTATION` of the rest; the CPU's available memory (0 when nothing is left)."""
    if device.kind == "cpu":
        return device.available_bytes if device.available_bytes is not None else device.memory_bytes
    return max(0, int((device.memory_bytes - RUNTIME_CONTEXT) * (1 - FRAGMENTATION)))


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/"

DEVICES: tuple[Device, ...] = (
    Device("H100 80GB", 80 * GB, "gpu", _NVIDIA_H100 + " (H100 SXM: 80 GB HBM3)", aliases=("h100", "h100 sxm")),
    Device("H100 NVL", 94 * GB, "gpu", _NVIDIA_H100 + " (H100 NVL: 94 GB HBM3)", aliases=("h100 94gb", "h100nvl")),
    Device(
        "H200",
        141 * GB,
        "gpu",
        "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ (141 GB HBM3e)",
        aliases=("h200 141gb", "h200 sxm"),
    ),
    Device("A100 40GB", 40 * GB, "gpu", _NVIDIA_A100 + " (A100 40GB: 40 GB HBM2)", aliases=("a100 40",)),
    Device("A100 80GB", 80 * GB, "gpu", _NVIDIA_A100 + " (A100 80GB: 80 GB HBM2e)", aliases=("a100", "a100 80")),
    Device(
        "L4",
        24 * GB,
        "gpu",
        "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/ (24 GB GDDR6)",
    ),
    Device(
        "T4",
        16 * GB,
        "gpu",
        "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/tesla-t4/ (16 GB GDDR6)",
    ),
    Device(
        "MI300X",
        192 * GB,
        "gpu",
        "AMD Instinct MI300X accelerator data sheet, "
        "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (192 GB HBM3)",
    ),
    Device(
        "MI325X",
        256 * GB,
        "gpu",
        "AMD Instinct MI325X accelerator data sheet, "
        "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html (256 GB HBM3E)",
    ),
    Device(
        "MI250X",
        64 * GB,
        "gpu",
        "AMD Instinct MI250X accelerator data sheet, "
        "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html (128 GB HBM2e on the package)",
        note="one GCD: an MI250X is two graphics compute dies of 64 GB each, and ROCm shows each as a device, so a "
        "rank gets 64 GB",
        aliases=("mi250x gcd",),
    ),
)


def _key(name: str) -> str:
    """A device name as looked up: case, spaces, dashes and underscores ignored."""
    return re.sub(r"[\s_\-]+", "", name).lower()


def _table() -> dict[str, Device]:
    out: dict[str, Device] = {}
    for d in DEVICES:
        for alias in (d.name, *d.aliases):
            out[_key(alias)] = d
    return out


def device_names() -> list[str]:
    """The names ``--gpu`` takes (each device once, aliases left out), ``cpu`` last."""
    return [d.name for d in DEVICES] + ["cpu"]


def cpu_device() -> Device:
    """This machine's memory, as ``psutil`` reads it: the total, and what is available now (the usable figure)."""
    import psutil

    memory = psutil.virtual_memory()
    return Device(
        "cpu",
        int(memory.total),
        "cpu",
        "this machine's memory (psutil.virtual_memory: total; usable: available now)",
        available_bytes=int(memory.available),
    )


def find_device(name: str, flag: str = "--gpu") -> Device:
    """The device called ``name`` (case, spaces and dashes ignored; ``cpu``: this machine); KdbenchError naming
    ``flag`` and the close names otherwise."""
    key = _key(name)
    if key == "cpu":
        return cpu_device()
    table = _table()
    if key in table:
        return table[key]
    close = did_you_mean(name.strip().upper(), [d.name for d in DEVICES], cutoff=0.5)
    raise KdbenchError(
        f"{flag} {name}: unknown device; {close}known: {', '.join(device_names())} (or give --device-memory SIZE)"
    )


def parse_size(text: str, flag: str = "--device-memory") -> int:
    """Bytes of a size as a user writes it: ``141GB`` (GB = 10^9), ``80GiB`` (GiB = 2^30), ``141 GB``, ``192e9``
    (bytes), ``1.5TB``; KdbenchError naming ``flag`` for anything else, and for a size that is not positive."""
    found = _SIZE.match(text)
    unit = found[2].lower() if found else None
    if unit is None or unit not in _UNITS:
        raise KdbenchError(
            f"{flag} {text!r}: not a size; write a number and a unit, e.g. 141GB (GB = 10^9 bytes), 80GiB "
            "(GiB = 2^30 bytes), 192e9 (bytes)"
        )
    value = float(found[1]) * _UNITS[unit]
    if value < 1:
        raise KdbenchError(f"{flag} {text.strip()}: must be a positive size, e.g. 80GB")
    return round(value)


def sized_device(text: str, flag: str = "--device-memory") -> Device:
    """A GPU of the memory ``text`` says (the GPU's headroom applies)."""
    nbytes = parse_size(text, flag)
    return Device(f"a device of {text.strip()}", nbytes, "gpu", f"given: {flag} {text.strip()}")
