"""How long a cell's step takes on a device: its operator census (:mod:`kdbench.fit.census`) priced with that
device's rates.

Per census record (``launches`` calls of one operator, in one phase and dtype, with their FLOPs and bytes)::

    time = max(flops / (peak[dtype] x compute_fraction[class]), bytes / (bandwidth x bandwidth_fraction[class]))
           + launches x launch_floor

and a collective by the ring formulas over the interconnect (n ranks, S its bytes, B the per-direction bandwidth
times its fraction): an all-reduce ``2 (n - 1) / n x S / B``, an all-gather or a reduce-scatter
``(n - 1) / n x S / B`` (S the gathered, or the scattered, whole).  The phases are summed in the order the step
runs them: nothing overlaps (not a collective with the backward it hides behind, not the host with the device).

Where each rate comes from (:class:`Rates`, each with its ``sources``):

* **On the machine itself** (:func:`rates_from_probe`, :func:`rates_from_row`): the probe's measured ceilings
  (``kdbench probe``: a dense matmul per dtype, a copy; :mod:`kdbench.measure.probe`), which every CPU row is
  predicted from.  They are achievable rates already: the fractions are 1, but for the classes the probe's
  large matmul and copy do not stand for, stated in :data:`CPU_FRACTIONS`.
* **A device of the table** (:func:`rates_for`): the catalogue's datasheet peaks and bandwidth
  (:mod:`kdbench.core.devices`) times published achievable fractions (:data:`GPU_FRACTIONS`, per vendor).
* **The launch floor**: what one operator costs beyond its roofline term, on the host that issues it
  (:data:`CPU_LAUNCH_US`, :data:`GPU_LAUNCH_US`).

No fitted model: each constant is stated once, below, with its source; docs/fit.md ("Step time") says what the
model ignores.  Torch's own estimators (``torch.utils._runtime_estimation``, ``torch.distributed._tools.
runtime_estimator``'s operator-level cost model) take ``max(flops / peak, bytes / bandwidth)`` with the datasheet's
figures: no achievable fraction, no launch cost, no collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kdbench.core.devices import Card
from kdbench.core.errors import KdbenchError
from kdbench.fit.census import (
    ALL_GATHER,
    ALL_REDUCE,
    ATTENTION,
    CLASSES,
    COLLECTIVES,
    COPIES,
    ELEMENTWISE,
    GROUPED,
    MATMUL,
    OPTIMIZER,
    REDUCTION,
    VIEWS,
    Census,
    Record,
    collective_kind,
)

COMPUTE, MEMORY, LAUNCH = "compute", "memory", "launch"  # what bounds a record's time (StepTime.bound's keys)

# torch dtype name -> the precision whose peak prices a matmul in it (float32 is tf32's under a tf32 cell)
DTYPE_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PRECISION_DTYPE = {v: k for k, v in DTYPE_PRECISION.items()}

# Operators whose every element costs an exp (or a function of one: log, tanh, erf) on a CPU's vector units, where
# the probe's exp rate (elements/s) bounds them below the copy's bandwidth; logsumexp's elements are its input's.
TRANSCENDENTAL = frozenset(
    {
        "exp", "exp_", "log", "log_", "_log_softmax", "_softmax", "_log_softmax_backward_data",
        "_softmax_backward_data", "logsumexp", "sigmoid", "sigmoid_", "sigmoid_backward", "tanh", "tanh_",
        "tanh_backward", "log1p", "expm1", "erf", "gelu", "gelu_backward", "silu", "silu_", "silu_backward",
        "softplus", "softplus_backward", "log_sigmoid_forward", "log_sigmoid_backward", "logaddexp", "xlogy",
        "special_xlog1py", "hardswish", "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "elu",
        "elu_backward", "mish", "mish_backward",
    }
)  # fmt: skip
_READS_ELEMENTS = frozenset({"logsumexp"})  # a reduction: its elements are what it reads
_BACKWARD = "_backward"


def _conv_kind(op: str) -> str | None:
    """``conv`` or ``conv_grouped`` for a convolution's (or its backward's) census record, else None."""
    if op.split(".", 1)[-1].startswith("convolution"):
        return "conv_grouped" if op.endswith(GROUPED) else "conv"
    return None


def _rate_kinds(r: Record) -> tuple[str, ...]:
    """The probe's class rates that may price record ``r``'s FLOPs, the first the probe has winning: a convolution's
    backward its own (``conv_backward``, ``conv_grouped_backward``), else its forward's; attention its own."""
    kind = _conv_kind(r.op)
    if kind:
        return (f"{kind}{_BACKWARD}", kind) if _BACKWARD in r.op else (kind,)
    return ("attention",) if r.cls == ATTENTION else ()


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

# --- the launch floor -------------------------------------------------------------------------------------------
# A CPU: what one eager aten operator of a step costs on the host beyond its arithmetic and bytes (its Python module
# call, the dispatch, autograd's graph and the engine's backward node, the allocator).  Calibrated from kdbench's
# own measured step, said so: the linear -> linear cell (nothing but overhead) on kdbench's CI machine type (2-core
# AMD EPYC VM, torch 2.14, 1 thread, the machine shared) took 0.81 ms for its 58 operators, 14 us each; a bare aten
# add from Python takes 1.3-2 us there.  benchmarks/bench_step_time.py measures both and prints them beside this.
CPU_LAUNCH_US = 10.0
# A GPU: one kernel launched into a stream, back to back.  Source: NVIDIA Technical Blog, "Getting Started with
# CUDA Graphs" (A. Gray, 2019): about 3.8 us per kernel launched back to back into a stream, down to 3.4 us in a
# graph; eager PyTorch adds its dispatch on the host, which overlaps the device's work unless the step is launch
# bound.  5 us stands for both.
GPU_LAUNCH_US = 5.0
# A CPU's first touch of pages its allocator maps anew (census.FRESH_BYTES: every storage of 32 MiB or more): the
# page faults and the kernel's zeroing, in GB/s of the storage.  A GPU's caching allocator reuses its blocks: none.
# Source: measured on kdbench's CI machine type (2-core AMD EPYC VM, 2 threads): filling a new 64 MiB tensor runs
# at 2.7 GB/s against 25 GB/s into one already touched; benchmarks/bench_step_time.py measures and prints it.
CPU_FIRST_TOUCH_GBPS = 2.7

# --- achievable fractions ---------------------------------------------------------------------------------------
# On the machine itself, of the probe's measured ceilings (a 2048 x 2048 fp32 matmul, a 64 MiB copy on a CPU).
# 1.0 where the probe's operation is the class's; stated otherwise.
CPU_FRACTIONS: dict[str, tuple[float, float]] = {  # class -> (of the matmul ceiling, of the copy bandwidth)
    MATMUL: (1.0, 1.0),
    ATTENTION: (1.0, 1.0),
    REDUCTION: (1.0, 1.0),
    ELEMENTWISE: (1.0, 1.0),
    OPTIMIZER: (1.0, 1.0),
    COPIES: (1.0, 1.0),
    COLLECTIVES: (1.0, 1.0),
}
CPU_FRACTION_SOURCE = (
    "the probe's own ceilings, measured on this machine (kdbench probe: the fast end of a dense matmul's and a "
    "copy's timed calls): achievable rates already, fraction 1"
)

# Of a table device's datasheet figures, per vendor.  matmul: a large dense GEMM of the vendor's BLAS; attention:
# the fused kernel torch's SDPA runs; bandwidth: a device-to-device copy (STREAM-like).
GPU_FRACTIONS: dict[str, dict[str, tuple[float, float]]] = {
    "nvidia": {
        MATMUL: (0.70, 0.85),
        ATTENTION: (0.35, 0.85),
        REDUCTION: (0.70, 0.80),
        ELEMENTWISE: (0.70, 0.85),
        OPTIMIZER: (0.70, 0.80),
        COPIES: (0.70, 0.85),
        COLLECTIVES: (1.0, 0.80),
    },
    "amd": {
        MATMUL: (0.45, 0.81),
        ATTENTION: (0.30, 0.81),
        REDUCTION: (0.45, 0.75),
        ELEMENTWISE: (0.45, 0.81),
        OPTIMIZER: (0.45, 0.75),
        COPIES: (0.45, 0.81),
        COLLECTIVES: (1.0, 0.70),
    },
}
GPU_FRACTION_SOURCES = {
    "nvidia": "matmul 0.70 of the dense peak: cuBLAS's large 16-bit GEMMs on H100 SXM run at roughly 650-750 of "
    "989 TFLOP/s (NVIDIA's Hopper figures and independent runs, e.g. SemiAnalysis, 'MI300X vs H100 vs H200 "
    "Benchmark Part 1: Training', 2024); attention 0.35: FlashAttention-2, which torch's SDPA runs, reaches about "
    "35 % of H100's peak (Shah et al., 'FlashAttention-3', 2024, abstract); bandwidth 0.85: a device-to-device "
    "copy reaches about 2.9 of H100 SXM's 3.35 TB/s; reductions and the optimizer's multi-tensor kernels 0.80; "
    "NCCL's bus bandwidth 0.80 of the link's per-direction figure (nccl-tests' busbw)",
    "amd": "matmul 0.45 and bandwidth 0.81 of MI300X's datasheet figures, as measured on real AI workloads "
    "(summarised in 'AMD MI300X hits only 45% of peak FLOPs in practice', aiweekly.co, from a peer-reviewed "
    "measurement: ~45 % of the BF16/FP16 peak, ~81 % of 5.3 TB/s); attention 0.30 (CK's flash attention, below "
    "hipBLASLt's GEMM); RCCL's bus bandwidth 0.70 of the Infinity Fabric's per-direction figure",
}


@dataclass(frozen=True)
class Rates:
    """What prices a census on one device: achievable matmul TFLOP/s per torch dtype (``float32`` means what the
    cell's precision runs it as: TF32 in a tf32 cell), memory GB/s, per-class fractions, the launch floor, the
    interconnect's per-direction GB/s (None: none known), and where each came from."""

    name: str
    peaks: Mapping[str, float]  # TFLOP/s by torch dtype name ("float32", "bfloat16", "float16")
    bandwidth: float  # GB/s
    fractions: Mapping[str, tuple[float, float]]  # class -> (of the peak, of the bandwidth)
    launch_us: float
    interconnect: float | None = None  # GB/s per direction
    first_touch: float | None = None  # GB/s of writing pages the OS maps anew (a CPU's; None: not priced)
    sources: Mapping[str, str] = field(default_factory=dict)
    # The probe's per-class rates (kdbench.measure.probe_classes), by torch dtype name; empty for a table device
    # attention, conv, conv_grouped, conv_backward, conv_grouped_backward
    class_peaks: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    exp: Mapping[str, float] = field(default_factory=dict)  # Gelem/s of a vectorised exp
    elementwise: Mapping[str, float] = field(default_factory=dict)  # GB/s of an elementwise kernel
    floors: Mapping[str, float] = field(default_factory=dict)  # us per bare call: op, conv, conv_backward
    # Seconds per call of an operator at its shapes, timed on this machine (kdbench.measure.replay), by signature;
    # empty for a table device
    calls: Mapping[str, float] = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        """TFLOP/s of a matmul writing ``dtype``; a dtype without a figure (int64, float64) gets the slowest."""
        found = self.peaks.get(dtype)
        return found if found else min(self.peaks.values())

    def peak_of(self, r: Record) -> float:
        """TFLOP/s of record ``r``'s FLOPs: its class's measured rate where the probe has one (attention, a dense or
        a grouped convolution or their backwards, in its dtype: :func:`_rate_kinds`), else the matmul's."""
        for kind in _rate_kinds(r):
            found = self.class_peaks.get(kind, {}).get(r.dtype)
            if found:
                return found
        return self.peak(r.dtype)

    def launch_of(self, r: Record) -> float:
        """Microseconds of one call of ``r``'s operator beyond its roofline: the launch floor, plus what a bare call of
        a convolution (or its backward) costs above a bare add where the probe measured both."""
        kind = _conv_kind(r.op)
        base = self.floors.get("op")
        extra = self.floors.get("conv_backward" if _BACKWARD in r.op else "conv") if kind else None
        return self.launch_us + (max(0.0, extra - base) if extra is not None and base is not None else 0.0)


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time: in all, per phase (in the order the step runs them) and per class, and the share of
    it each bound holds (compute, memory, launch: they sum to 1)."""

    ms: float
    phases: dict[str, float]
    classes: dict[str, float]
    bound: dict[str, float]
    rates: str  # the Rates' name
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        share = ", ".join(f"{k} {v:.0%}" for k, v in self.bound.items() if v >= 0.005)
        return f"{self.ms:,.2f} ms ({share}; {self.rates})"


def vendor(card: Card) -> str:
    return "amd" if card.isa.startswith("gfx") or card.name.startswith("MI") else "nvidia"


def rates_for(card: Card, precision: str) -> Rates:
    """A table device's rates for a cell in ``precision``: the datasheet's dense peaks and bandwidth times the
    vendor's published fractions (:data:`GPU_FRACTIONS`), its interconnect halved to one direction.  A device
    without a peak for ``precision`` (TF32 on a T4) is a user's mistake: one line, naming both."""
    peak = card.peaks.get(precision)
    if peak is None:
        have = ", ".join(p for p, v in card.peaks.items() if v is not None)
        raise KdbenchError(f"{card.name} has no {precision} figure in the device table; use one of {have}")
    fp32 = card.peaks["tf32"] if precision == "tf32" else card.peaks["fp32"]
    peaks = {"float32": fp32, "bfloat16": card.peaks.get("bf16"), "float16": card.peaks.get("fp16")}
    v = vendor(card)
    return Rates(
        name=f"{card.name} datasheet x {v} fractions",
        peaks={k: p for k, p in peaks.items() if p},
        bandwidth=card.memory_bandwidth,
        fractions=GPU_FRACTIONS[v],
        launch_us=GPU_LAUNCH_US,
        interconnect=card.interconnect / 2 if card.interconnect else None,
        sources={
            "peaks": card.sources["peaks"],
            "bandwidth": card.sources["memory_bandwidth"],
            "interconnect": card.sources["interconnect"],
            "fractions": GPU_FRACTION_SOURCES[v],
            "launch": "NVIDIA Technical Blog, 'Getting Started with CUDA Graphs' (2019): ~3.8 us per launch",
        },
    )


def rates_from_probe(
    ceiling: Mapping[str, Any], precision: str, device_type: str = "cpu", launch_us: float | None = None
) -> Rates | None:
    """The machine's own rates from a probe (:func:`kdbench.store.probes.latest_ceiling`'s form: ``matmul_<dtype>``
    TFLOP/s, ``copy`` GB/s, ``probe_id``) for a cell in ``precision``; None without a copy bandwidth or a matmul
    ceiling.  A GPU's probe gets the GPU's launch floor and its vendor-neutral fractions of 1."""
    copy = ceiling.get("copy")
    fp32 = ceiling.get("matmul_tf32") if precision == "tf32" else ceiling.get("matmul_fp32")
    peaks = {"float32": fp32, "bfloat16": ceiling.get("matmul_bf16"), "float16": ceiling.get("matmul_fp16")}
    peaks = {k: float(v) for k, v in peaks.items() if v}
    if not copy or not peaks:
        return None
    probe = ceiling.get("probe_id", "a probe")
    rates = _measured(f"probe {probe}", peaks, float(copy), device_type, launch_us)
    return with_classes(rates, ceiling)


def with_classes(rates: Rates, ceiling: Mapping[str, Any]) -> Rates:
    """``rates`` with the probe's per-class rates (``<kind>_<precision>`` keys of :func:`kdbench.store.probes.
    latest_ceiling`'s dict, :mod:`kdbench.measure.probe_classes`): a probe without them leaves ``rates`` as it is."""
    from dataclasses import replace

    def by_dtype(kind: str) -> dict[str, float]:
        found = {PRECISION_DTYPE[p]: ceiling.get(f"{kind}_{p}") for p in PRECISION_DTYPE}
        return {d: float(v) for d, v in found.items() if v}

    kinds = ("attention", "conv", "conv_grouped", "conv_backward", "conv_grouped_backward")
    classes = {k: by_dtype(k) for k in kinds}
    floors = {k: float(ceiling[f"launch_{k}"]) for k in ("op", "conv", "conv_backward") if ceiling.get(f"launch_{k}")}
    extra = {
        "class_peaks": {k: v for k, v in classes.items() if v},
        "exp": by_dtype("exp"),
        "elementwise": by_dtype("elementwise"),
        "floors": floors,
    }
    if not any(extra.values()):
        return rates
    source = "the probe's per-class rates (kdbench.measure.probe_classes), measured on this machine"
    return replace(rates, **extra, sources={**rates.sources, "classes": source})


def with_calls(rates: Rates, calls: Mapping[str, float]) -> Rates:
    """``rates`` with ``calls``: seconds per call of operators timed at their shapes on this machine
    (:func:`kdbench.measure.replay.time_signatures`), which price those calls in place of their roofline term
    (:func:`record_terms`); none leaves ``rates`` as it is."""
    from dataclasses import replace

    if not calls:
        return rates
    source = (
        f"{len(calls)} operator calls timed at their shapes on this machine (kdbench.measure.replay: torch's "
        "operator-level benchmark)"
    )
    return replace(
        rates,
        name=f"{rates.name} + {len(calls)} operators timed here",
        calls={**rates.calls, **calls},
        sources={**rates.sources, "calls": source},
    )


def rates_from_row(row: Mapping[str, Any], precision: str, teacher_precision: str | None = None) -> Rates | None:
    """The machine's own rates from a row's probe columns (``ceiling_tflops`` at the row's precision,
    ``teacher_ceiling_tflops`` at the teacher's, ``ceiling_gbps``); None where it has none."""
    copy, student, teacher = (row.get(k) for k in ("ceiling_gbps", "ceiling_tflops", "teacher_ceiling_tflops"))
    peaks: dict[str, float] = {}
    for p, v in ((teacher_precision, teacher), (precision, student)):
        if p and v:
            peaks[_dtype_of(p)] = float(v)
    if not copy or not peaks:
        return None
    device_type = "cuda" if str(row.get("device", "cpu")).startswith("cuda") else "cpu"
    return _measured(f"probe {row.get('ceiling_probe_id') or '(the row)'}", peaks, float(copy), device_type, None)


def _dtype_of(precision: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")


def _measured(name: str, peaks: dict[str, float], copy: float, device_type: str, launch_us: float | None) -> Rates:
    gpu = device_type != "cpu"
    floor = launch_us if launch_us is not None else (GPU_LAUNCH_US if gpu else CPU_LAUNCH_US)
    return Rates(
        name=name,
        peaks=peaks,
        bandwidth=copy,
        fractions=CPU_FRACTIONS,
        launch_us=floor,
        interconnect=None,
        first_touch=None if gpu else CPU_FIRST_TOUCH_GBPS,
        sources={
            "peaks": CPU_FRACTION_SOURCE,
            "bandwidth": CPU_FRACTION_SOURCE,
            "launch": "GPU_LAUNCH_US" if gpu else "CPU_LAUNCH_US",
            "first touch": "none: a GPU's caching allocator" if gpu else "CPU_FIRST_TOUCH_GBPS",
        },
    )


def record_terms(r: Record, rates: Rates, world_size: int = 1) -> tuple[float, float, str]:
    """(roofline seconds, launch seconds, what bounds the roofline: compute or memory) of one census record on
    ``rates`` (module docstring); a collective's wire time is its memory term.  The calls of ``r`` timed at their
    shapes on this machine (``rates.calls``) take their timed seconds in place of their share of the roofline term,
    less the bare dispatch each timed call holds (the probe's ``launch_op``, which the launch floor prices)."""
    if r.cls == VIEWS:
        return 0.0, 0.0, MEMORY
    timed = [(n, rates.calls[sig]) for sig, n in r.shapes if sig in rates.calls] if rates.calls else []
    if timed:
        roof, launch, what = _roofline_terms(r, rates, world_size)
        calls = sum(n for n, _ in timed)
        bare = rates.floors.get("op", 0.0) * 1e-6
        measured = sum(n * max(0.0, t - bare) for n, t in timed)
        rest = roof * max(0, r.launches - calls) / r.launches if r.launches else 0.0
        return measured + rest, launch, what
    return _roofline_terms(r, rates, world_size)


def _roofline_terms(r: Record, rates: Rates, world_size: int) -> tuple[float, float, str]:
    launch = r.launches * rates.launch_of(r) * 1e-6
    compute_share, bandwidth_share = rates.fractions.get(r.cls, (1.0, 1.0))
    if r.cls == COLLECTIVES:
        n = max(1, world_size)
        kind = collective_kind(r.op)
        factor = 2 * (n - 1) / n if kind == ALL_REDUCE else (n - 1) / n
        size = r.written if kind == ALL_GATHER else r.read
        link = rates.interconnect or rates.bandwidth  # one host's ranks (gloo on a CPU): its memory
        return factor * size / (link * 1e9 * bandwidth_share), launch, MEMORY
    compute = r.flops / (rates.peak_of(r) * 1e12 * compute_share) if r.flops else 0.0
    op = r.op.split(".", 1)[-1]
    if rates.exp.get(r.dtype) and op in TRANSCENDENTAL:
        elements = (r.read if op in _READS_ELEMENTS else r.written) / _ITEMSIZE.get(r.dtype, 4)
        compute = max(compute, elements / (rates.exp[r.dtype] * 1e9))
    bandwidth = rates.elementwise.get(r.dtype) if r.cls == ELEMENTWISE else None
    memory = r.bytes / ((bandwidth or rates.bandwidth) * 1e9 * bandwidth_share)
    if rates.first_touch and r.fresh:  # new pages: each faults on its first write
        memory += r.fresh / (rates.first_touch * 1e9)
    return max(compute, memory), launch, COMPUTE if compute > memory else MEMORY


def record_time(r: Record, rates: Rates, world_size: int = 1) -> float:
    """Seconds of one census record on ``rates``: its roofline term plus its launches."""
    roof, launch, _ = record_terms(r, rates, world_size)
    return roof + launch


def predict_step_time(source: Any, rates: Rates | Card, precision: str = "fp32") -> StepTime:
    """The predicted time of the step whose census ``source`` is (a :class:`~kdbench.fit.census.Census`, or a
    planner's :class:`~kdbench.fit.planner.Prediction` that holds one) on ``rates`` (or a table :class:`Card`,
    priced with :func:`rates_for` at ``precision``)."""
    census = source if isinstance(source, Census) else getattr(source, "census", None)
    if census is None:
        raise ValueError("no operator census to price (an unpredictable cell)")
    if isinstance(rates, Card):
        rates = rates_for(rates, precision)
    phases: dict[str, float] = {}
    classes: dict[str, float] = {c: 0.0 for c in CLASSES}
    bound = {COMPUTE: 0.0, MEMORY: 0.0, LAUNCH: 0.0}
    for r in census.records:
        if r.cls == VIEWS:
            continue
        roof, launch, what = record_terms(r, rates, census.world_size)
        ms = (roof + launch) * 1e3
        phases[r.phase] = phases.get(r.phase, 0.0) + ms
        classes[r.cls] += ms
        bound[what] += roof * 1e3
        bound[LAUNCH] += launch * 1e3
    total = sum(phases.values())
    shares = {k: (v / total if total > 0 else 0.0) for k, v in bound.items()}
    return StepTime(total, phases, {k: v for k, v in classes.items() if v > 0}, shares, rates.name)
