"""The devices a prediction is judged against: the named accelerators of the device catalogue
(:mod:`kdbench.core.devices`, each card's memory with its source), the GPU this process runs on (measured now),
``cpu`` (this machine's memory), a device of a size the user gives (``141GB``, ``80GiB``), and the headroom model
that turns a device's memory into what a step's peak may reach (:func:`usable`).

Sizes (:mod:`kdbench.core.sizes`): ``GB`` / ``TB`` are decimal (10^9, 10^12 bytes), ``GiB`` / ``TiB`` binary
(2^30, 2^40), a bare number is bytes.  A datasheet's "80GB" is 80 x 10^9 bytes; what torch reports as the device's
total is another figure (79.11 GiB on an H100 80GB, 14.75 GiB on a T4: more and less than the datasheet's), which the
catalogue holds with the print it comes from where one was found (:attr:`kdbench.core.devices.Card.reported_memory`).

Headroom (:func:`usable`), what each part is and where it comes from:

* the **total**: the GPU this process runs on, ``torch.cuda.mem_get_info()``'s free memory now (measured: its own
  context and every other process already out of it); a catalogue card, the total torch reports (a public print),
  else its datasheet's figure; ``--device-memory SIZE``, the size given, read as torch's total;
* the runtime's **context** (:class:`kdbench.fit.runtime.Runtime`: 768 MiB for CUDA, 1 GiB for ROCm, each an
  assumption with its sources), kept off a table's total;
* the collective library's **buffers** of a ``world_size > 1`` cell (NCCL's or RCCL's allowance per rank), outside the
  allocator, kept off too: they are the prediction's ``comm_bytes``;
* **fragmentation**: the caching allocator's rounding and fragmentation, ``memory_reserved`` over
  ``memory_allocated``, grows with what the step allocates, not with the card: :data:`FRAGMENTATION` (5 %) of the
  step's peak is kept, so the peak may reach the rest divided by 1.05.  An assumption, which the device check's
  reserved / allocated print settles.

The BLAS libraries' workspaces are allocated through the caching allocator, so they are in the measured peak: they
are a term of the prediction (:func:`kdbench.fit.runtime.with_runtime`), not of the headroom.  The CPU has none of
this: its usable memory is what the operating system reports available now (``psutil``).

Torch-free, but for :func:`this_gpu`, which imports torch to read the GPU this process runs on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kdbench.core.devices import CATALOGUE, Card, find_card, name_key
from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.core.sizes import GB, gib, read_size
from kdbench.fit.runtime import Runtime, platform_of, runtime_for

FRAGMENTATION = 0.05  # of the step's peak, kept for the caching allocator's rounding and fragmentation (assumed)


@dataclass(frozen=True)
class Device:
    """A device a cell's step runs on: its memory per device (one rank's), what kind it is, where the figure comes
    from, and (a GPU) its runtime's figures."""

    name: str
    memory_bytes: int  # the datasheet's (a catalogue card), the size given, or torch's total (this process's GPU)
    kind: str  # "gpu" (context, workspaces and fragmentation apply) or "cpu"
    source: str  # the vendor's datasheet (name and address), or how the figure was read
    note: str = ""
    available_bytes: int | None = None  # cpu: what the OS reports available (the usable figure)
    card: Card | None = None  # the catalogue's entry of a named accelerator (None: cpu, or a size given)
    total_bytes: int | None = None  # what torch reports as the total (None: memory_bytes stands in)
    total_source: str = ""  # where total_bytes comes from
    runtime: Runtime | None = None  # a GPU's context, BLAS workspaces and collective buffers
    free_bytes: int | None = None  # the GPU this process runs on: mem_get_info's free memory when it was read

    @property
    def live(self) -> bool:
        """Measured now (the GPU this process runs on) rather than taken from a table."""
        return self.free_bytes is not None

    @property
    def total(self) -> int:
        return self.total_bytes if self.total_bytes is not None else self.memory_bytes

    @property
    def usable_bytes(self) -> int:
        """What a one-device step's peak may reach (:func:`usable`, no collective buffers)."""
        return usable(self)

    def describe(self) -> str:
        """One line: the device, its memory, what a step's peak may reach of it, and what was kept and why."""
        if self.kind == "cpu":
            return (
                f"{self.name}: {gib(self.memory_bytes)} ({self.memory_bytes / GB:g} GB), usable "
                f"{gib(self.usable_bytes)} per device (what the OS reports available)"
            )
        runtime = self.runtime or runtime_for("cuda")
        platform = {"cuda": "CUDA", "rocm": "ROCm"}.get(runtime.platform, runtime.platform)
        kept = f"{runtime.context_bytes / 2**20:,.0f} MiB {platform} context kept"
        if self.live:
            memory = f"{gib(self.total)} as torch reports it, {gib(self.free_bytes)} free now (mem_get_info)"
            kept = "its context and other processes already out of the free memory"
        elif self.card is None:
            memory = f"{gib(self.total)} ({self.total / GB:g} GB) as torch's total"
        elif self.total_bytes is not None:
            memory = f"{gib(self.total_bytes)} as torch reports it (datasheet: {self.memory_bytes / GB:g} GB)"
        else:
            memory = (
                f"{gib(self.memory_bytes)} ({self.memory_bytes / GB:g} GB, the datasheet's: torch's total not seen)"
            )
        return (
            f"{self.name}: {memory}; usable {gib(self.usable_bytes)} per device for a step's peak ({kept}, "
            f"{FRAGMENTATION:.0%} of the peak for fragmentation; {runtime.describe()})"
        )


def usable(device: Device, outside_bytes: int = 0) -> int:
    """What a step's peak (its caching allocator's, BLAS workspaces included) may reach on ``device`` when the step
    also holds ``outside_bytes`` outside the allocator (NCCL's or RCCL's buffers per rank):

        usable = (M - C - outside) / (1 + FRAGMENTATION)

    M: the GPU this process runs on: the memory free now (mem_get_info); a table's card or a size given: the total
    torch reports (else the datasheet's).  C: the runtime's context (:attr:`kdbench.fit.runtime.Runtime.
    context_bytes`; 0 for the GPU measured now, whose free memory is after it).  The peak P fits when
    P + FRAGMENTATION x P + outside + C <= M: the caching allocator's waste grows with what it holds, not with the
    card.  The CPU: the memory the OS reports available (0 when nothing is left)."""
    if device.kind == "cpu":
        return device.available_bytes if device.available_bytes is not None else device.memory_bytes
    context = 0 if device.live else (device.runtime or runtime_for("cuda")).context_bytes
    room = (device.free_bytes if device.live else device.total) - context
    return max(0, int((room - outside_bytes) / (1 + FRAGMENTATION)))


def headroom_figures(device: Device) -> dict[str, int | float | str]:
    """The headroom model's figures for a GPU ``device``, to print beside what the GPU measures (the device check:
    ``total - free - reserved`` against ``context_bytes``, ``memory_reserved / memory_allocated`` at the peak against
    1 + ``fragmentation``, measured / predicted against the ``workspace_bytes`` the prediction counts): the total
    the model starts from and where it comes from, the context kept, a step's BLAS workspaces, the fragmentation
    share of the peak, and what a one-device step's peak may reach."""
    runtime = device.runtime or runtime_for("cuda")
    return {
        "total_bytes": device.free_bytes if device.live else device.total,
        "total_source": "mem_get_info: free now" if device.live else (device.total_source or device.source),
        "context_bytes": 0 if device.live else runtime.context_bytes,
        "workspace_bytes": runtime.step_workspace_bytes,
        "workspaces": runtime.describe(),
        "fragmentation": FRAGMENTATION,
        "usable_bytes": usable(device),
    }


def _gpu(card: Card) -> Device:
    return Device(
        card.name,
        card.memory_bytes,
        "gpu",
        card.sources["memory"],
        note=card.note,
        card=card,
        total_bytes=card.reported_memory,
        total_source=card.reported_source,
        runtime=runtime_for(platform_of(card.isa), card.isa),
    )


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


def this_gpu(env: Mapping[str, str] | None = None) -> Device | None:
    """The GPU this process runs on (torch's current device), measured now: ``torch.cuda.mem_get_info()``'s free and
    total memory, its name and catalogue card, and its runtime (CUDA or ROCm, its instruction set); None where torch
    sees no GPU.  Reading it creates this process's context, which the free memory is then after."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; a torch-free caller simply has no GPU
        return None
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    name = torch.cuda.get_device_name(index)
    rocm = bool(getattr(torch.version, "hip", None))
    arch = (getattr(props, "gcnArchName", "") or "") if rocm else ""
    isa = arch.split(":")[0] if rocm else f"sm_{props.major}{props.minor}"
    free, total = (int(n) for n in torch.cuda.mem_get_info(index))
    card = find_card(name, getattr(props, "multi_processor_count", None), arch or None)
    return Device(
        card.name if card is not None else name,
        card.memory_bytes if card is not None else total,
        "gpu",
        f"this machine's GPU {index} ({name}), measured now: torch.cuda.mem_get_info() (free, total)",
        note=card.note if card is not None else "",
        card=card,
        total_bytes=total,
        total_source="torch.cuda.mem_get_info(): the total",
        runtime=runtime_for("rocm" if rocm else "cuda", isa, env),
        free_bytes=free,
    )


def find_device(name: str, flag: str = "--gpu", live: bool = True) -> Device:
    """The device called ``name`` (a catalogue name or alias, case, spaces and dashes ignored, or the name torch
    reports; ``cpu``: this machine); KdbenchError naming ``flag`` and the close names otherwise.  With ``live``, a
    card that is the GPU this process runs on is that GPU measured now (:func:`this_gpu`), not the table's entry."""
    if name_key(name) == "cpu":
        return cpu_device()
    card = find_card(name)
    if card is not None:
        here = this_gpu() if live else None
        return here if here is not None and here.card is card else _BY_NAME[card.name]
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
    """A GPU of the memory ``text`` says, read as the total torch reports; taken as a CUDA device of an architecture
    not known (its context, and the 32 MiB cuBLAS workspaces of the newest cards: ``--gpu NAME`` for a card's own)."""
    nbytes = parse_size(text, flag)
    return Device(
        f"a device of {text.strip()}",
        nbytes,
        "gpu",
        f"given: {flag} {text.strip()}",
        total_bytes=nbytes,
        total_source=f"given: {flag} {text.strip()}",
        runtime=runtime_for("cuda"),
    )
