"""The devices a prediction is judged against: the named accelerators of the device catalogue
(:mod:`kdbench.core.devices`, each card's memory with its source), ``cpu`` (this machine's memory), a device of a
size the user gives (``141GB``, ``80GiB``), and the headroom model that turns a device's memory into what a step
may use.

Sizes (:mod:`kdbench.core.sizes`): ``GB`` / ``TB`` are decimal (10^9, 10^12 bytes), ``GiB`` / ``TiB`` binary
(2^30, 2^40), a bare number is bytes.  A datasheet's "80GB" is read as 80 x 10^9 bytes, which is at most what
the card holds: NVIDIA's and AMD's HBM figures are the stacks' size, and torch reports somewhat more (a few GiB on
an H100 or H200) than the decimal figure; reading it as decimal keeps a verdict of ``fits`` on the safe side.

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

from dataclasses import dataclass

from kdbench.core.devices import CATALOGUE, Card, find_card, name_key
from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.core.sizes import GB, GIB, gib, read_size

RUNTIME_CONTEXT = GIB  # a GPU runtime's own context and library workspaces (an assumption: see the module's notes)
FRAGMENTATION = 0.05  # the share of the rest kept for the caching allocator's rounding and fragmentation (assumed)


@dataclass(frozen=True)
class Device:
    """A device a cell's step runs on: its memory per device (one rank's), what kind it is, and where the figure
    comes from."""

    name: str
    memory_bytes: int
    kind: str  # "gpu" (the runtime context and fragmentation apply) or "cpu"
    source: str  # the vendor's datasheet (name and address), or how the figure was read
    note: str = ""
    available_bytes: int | None = None  # cpu: what the OS reports available (the usable figure)
    card: Card | None = None  # the catalogue's entry of a named accelerator (None: cpu, or a size given)

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


def _gpu(card: Card) -> Device:
    return Device(card.name, card.memory_bytes, "gpu", card.sources["memory"], note=card.note, card=card)


DEVICES: tuple[Device, ...] = tuple(_gpu(card) for card in CATALOGUE)  # the catalogue's cards, as the fit judges them
_BY_NAME = {d.name: d for d in DEVICES}


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
    """The device called ``name`` (a catalogue name or alias, case, spaces and dashes ignored, or the name torch
    reports; ``cpu``: this machine); KdbenchError naming ``flag`` and the close names otherwise."""
    if name_key(name) == "cpu":
        return cpu_device()
    card = find_card(name)
    if card is not None:
        return _BY_NAME[card.name]
    close = did_you_mean(name.strip().upper(), [d.name for d in DEVICES], cutoff=0.5)
    raise KdbenchError(
        f"{flag} {name}: unknown device; {close}known: {', '.join(device_names())} (or give --device-memory SIZE)"
    )


def parse_size(text: str, flag: str = "--device-memory") -> int:
    """Bytes of a size as a user writes it: ``141GB`` (GB = 10^9), ``80GiB`` (GiB = 2^30), ``141 GB``, ``192e9``
    (bytes), ``1.5TB``; KdbenchError naming ``flag`` for anything else, and for a size that is not positive."""
    value = read_size(text)
    if value is None:
        raise KdbenchError(
            f"{flag} {text!r}: not a size; write a number and a unit, e.g. 141GB (GB = 10^9 bytes), 80GiB "
            "(GiB = 2^30 bytes), 192e9 (bytes)"
        )
    if value < 1:
        raise KdbenchError(f"{flag} {text.strip()}: must be a positive size, e.g. 80GB")
    return round(value)


def sized_device(text: str, flag: str = "--device-memory") -> Device:
    """A GPU of the memory ``text`` says (the GPU's headroom applies)."""
    nbytes = parse_size(text, flag)
    return Device(f"a device of {text.strip()}", nbytes, "gpu", f"given: {flag} {text.strip()}")
