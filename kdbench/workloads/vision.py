"""Image classifiers: the registry's CIFAR, toy and torchvision models (and ``module:callable``) on synthetic image
batches, distilled through their logits and features, served by forward latency.

The models.  :func:`cell_model` makes a fresh copy of the seeded model from the worker's cache, its classifier
padded to ``pad_to``, on the device in the cell's memory format.  The step's row records what the layout settings
realised on the real tensors (:func:`layout_columns`).

Serving.  :func:`measure_inference` times the forward in eval() under inference_mode at the cell's precision; the
student is served by the cell's ``inference.runtime`` (and replayed from a graph with ``graphs``), its outputs
checked against eager's first (:mod:`kdbench.measure.runtimes`); the teacher is served eagerly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.names import INFERENCE_MODE, Measurement
from kdbench.core.schema import Row
from kdbench.core.worker_state import current
from kdbench.data.synthetic import synthetic_batch
from kdbench.distill.losses import check_method, needs_features
from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast
from kdbench.hw.layout import pad_classifier, padded_width, place_model, verify_memory_format
from kdbench.measure import walltime
from kdbench.measure.flops import count_flops
from kdbench.measure.levers import quiesce_compile_workers, release_compiled
from kdbench.measure.rows import measured_loop, timed_row
from kdbench.measure.runtimes import Served, serve
from kdbench.models import ModelCache
from kdbench.workloads.base import (
    Pair,
    Problems,
    Workload,
    encoder_methods,
    model_of,
    served_precision_note,
    serving_plan,
)

# --------------------------------------------------------------------------- models and layout


def cell_model(name: str, config: CellConfig, backend: Backend, cache: ModelCache) -> nn.Module:
    """A fresh copy of model ``name`` as the cell uses it: its classifier padded, on the device in the cell's
    memory format."""
    model = cache.get(name, config.data.num_classes, tuple(config.data.shape), config.seed)
    pad_classifier(model, config.data.num_classes, config.pad_to)  # before the memory format: new weights
    return place_model(model, backend.device, config.memory_format, len(config.data.shape) == 3)


def model_pair(config: CellConfig, backend: Backend, cache: ModelCache) -> Pair:
    """Fresh copies of the cell's teacher and student, on the device in the cell's memory format."""
    teacher = cell_model(config.pair.teacher, config, backend, cache)
    return teacher, cell_model(config.pair.student, config, backend, cache)


def layout_note(config: CellConfig, device_type: str) -> str:
    """ROCm: PyTorch hands MIOpen NCHW tensors unless PYTORCH_MIOPEN_SUGGEST_NHWC=1, so a channels_last
    cell measures layout conversions around NCHW kernels (the strides still verify)."""
    rocm = device_type == "cuda" and bool(getattr(torch.version, "hip", None))
    if not rocm or config.memory_format != "channels_last" or os.environ.get("PYTORCH_MIOPEN_SUGGEST_NHWC") == "1":
        return ""
    return (
        "channels_last on ROCm without PYTORCH_MIOPEN_SUGGEST_NHWC=1: MIOpen runs NCHW kernels with layout "
        "conversions around them (set it, and PYTORCH_MIOPEN_SUGGEST_NHWC_BATCHNORM=1, for NHWC kernels)"
    )


def alignment_note(x: torch.Tensor, config: CellConfig) -> str | None:
    """The input's placement when ``alignment`` is below its element size (it cannot be placed finer)."""
    if config.alignment < x.element_size():
        return (
            f"alignment {config.alignment} is below the {x.element_size()}-byte element size of the input; "
            f"placed at {x.element_size()}"
        )
    return None


def layout_columns(model: nn.Module, x: torch.Tensor, config: CellConfig) -> Row:
    """What the cell's layout settings realised, checked on the real tensors."""
    return {
        "data_ptr_mod64": x.data_ptr() % 64,
        "memory_format_verified": verify_memory_format(model, x, config.memory_format),
        "padded_classes": padded_width(config.data.num_classes, config.pad_to),
    }


# --------------------------------------------------------------------------- serving


def inference_forward(
    model: nn.Module, batch_size: int, config: CellConfig, backend: Backend
) -> tuple[Callable[[], Any], torch.Tensor, AutocastChoice]:
    """The call inference measurements time: ``model`` (put in eval()) on a fixed synthetic batch, under
    inference_mode and the cell's precision; with that batch and the precision's choice.  Time it
    inside ``math_mode(choice.tf32)``."""
    x, _ = synthetic_batch(config, batch_size, backend.device, config.seed + 1)
    choice = choose_autocast(backend, config.precision)
    model.eval()

    def forward() -> Any:
        with torch.inference_mode(), choice.context(backend.device_type):
            return model(x)

    return forward, x, choice


def inference_flops(forward: Callable[[], Any], model: str, batch_size: int, config: CellConfig) -> int:
    """The FLOPs of ``model``'s eager forward at ``batch_size`` (the same at every precision and seed), counted once
    per worker for each model, classifier width and input (:class:`kdbench.core.worker_state.WorkerState`).  Not
    per seed: a seed changes the weights and the input's values, not the work; keyed by it, a seed sweep counted
    every cell's FLOPs again and the worker's table grew by one entry a cell (issue 45)."""
    counted = current().inference_flops
    key = (model, config.data.num_classes, config.pad_to, tuple(config.data.shape), batch_size)
    if key not in counted:
        counted[key] = count_flops(forward)
    return counted[key]


def served_columns(served: Served) -> Row:
    check = served.check
    return {
        "one_off_ms": served.one_off_ms,
        "one_off_kind": served.one_off_kind,
        "graph_breaks": served.graph_breaks,
        "compiled_graphs": served.compiled_graphs,
        "output_check": check.text() if check is not None else None,
        "output_max_abs_diff": check.max_abs_diff if check is not None else None,
        "output_top1_agreement": check.top1_agreement if check is not None else None,
    }


SYNCHRONOUS_RUNTIME = (
    "{runtime}'s calls block the host until the device is done, so host and device time agree by construction: "
    "launch-bound is not judged"
)
OWN_ALLOCATOR = (
    "{runtime} allocates device memory from its own arena, which torch's memory statistics do not see: the "
    "memory columns are left empty"
)


def outside_torch(served: Served | None, profile: Row, backend: Backend) -> tuple[bool, list[str]]:
    """A runtime outside torch (ONNX Runtime) on a GPU: never judged launch-bound, memory columns empty.  Whether
    launch-bound is judged, and the notes that say what was not (``profile`` is changed in place)."""
    if served is None or backend.device_type != "cuda" or not (served.synchronous or served.own_memory):
        return True, []
    notes = []
    if served.synchronous:
        notes.append(SYNCHRONOUS_RUNTIME.format(runtime=served.runtime))
    if served.own_memory:
        for column in ("peak_memory_bytes", "peak_reserved_bytes", "memory_growth_bytes", "memory_footprint_bytes"):
            profile[column] = None
        notes.append(OWN_ALLOCATOR.format(runtime=served.runtime))
    return not served.synchronous, notes


def measure_inference(
    model: nn.Module, role: str, batch_size: int, config: CellConfig, backend: Backend, budget_s: float | None
) -> Row:
    """Forward latency in eval() under inference_mode, at the cell's precision; the student served by the
    cell's ``inference.runtime`` (and replayed from a graph with ``graphs``), its outputs checked against
    eager's first (:mod:`kdbench.measure.runtimes`).  The teacher is served eagerly."""
    forward, x, choice = inference_forward(model, batch_size, config, backend)
    served = None
    if role == "student" and (config.inference.runtime != "eager" or config.graphs):
        with walltime.spent(walltime.LEVERS):
            served = serve(model, x, config.inference.runtime, config, backend, graphs=config.graphs)
            if config.inference.runtime == "compile":
                quiesce_compile_workers()  # inductor's worker pool would start up while this is timed
    timed = served.forward if served is not None else forward
    what = f"{config.pair.teacher}->{config.pair.student} {config.precision} {role}_inference bs{batch_size}"
    m = measured_loop(
        timed,
        config,
        backend,
        batch_size,
        budget_s,
        choice.tf32,
        lambda: inference_flops(forward, getattr(config.pair, role), batch_size, config),
        what=what,
    )
    raw, profile, note, flags, flops = m.raw, m.profile, m.note, m.flags, m.counted
    if served is not None and served.compiled:
        release_compiled(backend)  # the compiled forward's CUDA graph pool, before the next measurement's peaks
    judge_launch, runtime_notes = outside_torch(served, profile, backend)
    served_row = served_columns(served) if served is not None else {}
    row = timed_row(
        Measurement(f"{role}_inference"),
        batch_size,
        raw,
        choices=(choice,),
        notes=(
            note,
            layout_note(config, backend.device_type),
            raw.note or "",
            *(served.notes if served else ()),
            *runtime_notes,
            alignment_note(x, config) or "",
            served_precision_note(Measurement(f"{role}_inference"), config),
        ),
        judge_launch=judge_launch,
        **profile,
        **flags,
        flops=flops,
        autocast=choice.applied,
        runtime=served.runtime if served is not None else "eager",
        grad_mode=None if served is not None and served.runtime.startswith("onnxruntime") else INFERENCE_MODE,
        **served_row,
        **layout_columns(model, x, config),
    )
    if served_row.get("one_off_ms") is not None:  # what serving this way paid once: the build and its cold calls
        row["one_off_ms"] += row["cold_excess_ms"]
    return row


# --------------------------------------------------------------------------- the workload


class VisionWorkload(Workload):
    family = "vision"
    a_pair = "an image pair"
    pairs = "image pairs"
    takes = frozenset({"world_size", "inference.runtime", "graphs", "pad_to"})
    quality_data = "images"

    def check(self, config: CellConfig, allow_imports: bool) -> Problems:
        from kdbench.distill.hooks import check_feature_count, check_feature_paths
        from kdbench.models import check_model_input, check_model_name

        problems: Problems = []

        def check(key: tuple[str, ...], fn, *args) -> bool:
            try:
                fn(*args)
            except KdbenchError as exc:
                problems.append((key, str(exc)))
                return False
            return True

        for role in ("teacher", "student"):
            name = getattr(config.pair, role)
            if check(("pair", role), check_model_name, name, allow_imports):
                check(("pair", role), check_model_input, name, config.data.shape)
        try:
            methods = check_method(config.method)
        except KdbenchError:
            return problems  # the plan reports the method itself
        if encoder_methods(methods, "image classifiers"):
            return problems + encoder_methods(methods, "image classifiers")
        lm_only = [m.name for m in methods if m.cls.domain == "lm"]
        if lm_only:
            problems.append(
                (
                    ("method",),
                    f"{', '.join(lm_only)} compare(s) next-token distributions of language models; this pair is image "
                    "classifiers: use kd, dkd or a feature method, or an LM pair with data.kind: tokens",
                )
            )
            return problems
        if needs_features(config.method):
            feats = config.features
            check(("features",), check_feature_count, feats.teacher, feats.student)
            for role in ("teacher", "student"):
                check(
                    ("features", role),
                    check_feature_paths,
                    role,
                    getattr(config.pair, role),
                    getattr(feats, role),
                    config.data.num_classes,
                    tuple(config.data.shape),
                    allow_imports,
                )
        return problems

    def planned(self, config: CellConfig) -> list[tuple[Measurement, int]]:
        return serving_plan(config, (Measurement.STUDENT_INFERENCE,), (Measurement.TEACHER_INFERENCE,))

    def config_columns(self, config: CellConfig) -> Row:
        return {
            "data_shape": "x".join(map(str, config.data.shape)),
            "num_classes": config.data.num_classes,
            "kd_temperature": config.kd.temperature,
            "kd_alpha": config.kd.alpha,
        }

    def model_key(self, config: CellConfig, role: str) -> tuple:
        return getattr(config.pair, role), tuple(config.data.shape), config.precision, config.memory_format

    def build_pair(self, config: CellConfig, backend: Backend, cache: ModelCache) -> Pair:
        return model_pair(config, backend, cache)

    def batch(
        self, config: CellConfig, batch_size: int, device: torch.device, seed: int, models: Pair
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return synthetic_batch(config, batch_size, device, seed)

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: CellConfig) -> Any:
        from kdbench.distill.hooks import resolve_paths

        return resolve_paths(teacher, student, example, config.features.teacher, config.features.student)

    def loss(self, config: CellConfig, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Backend):
        from kdbench.distill.losses import DistillLoss

        return DistillLoss(config, shapes)

    def step_columns(self, step: Any, config: CellConfig, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]:
        notes = (alignment_note(x, config) or "", layout_note(config, x.device.type))
        return layout_columns(step.distiller.student, x, config), notes

    def serve(
        self,
        measurement: Measurement,
        batch_size: int,
        pair: Pair,
        config: CellConfig,
        backend: Backend,
        budget_s: float | None,
    ) -> Row:
        role, model = model_of(measurement, pair)
        return measure_inference(model, role, batch_size, config, backend, budget_s)


VISION = VisionWorkload()
