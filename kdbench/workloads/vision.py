"""Image classifiers: the registry's CIFAR, toy and torchvision models (and ``module:callable``) on
synthetic image batches, distilled through their logits and features, served by forward latency."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kdbench.distill.losses import check_method, needs_features
from kdbench.errors import KdbenchError
from kdbench.names import Measurement
from kdbench.schema import Row
from kdbench.workloads.base import Problems, Workload


class Vision(Workload):
    family = "vision"

    def check(self, config: Any, allow_imports: bool) -> Problems:
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
        if config.parallel == "fsdp":
            why = "parallel fsdp shards language-model pairs decoder layer by decoder layer; image pairs take ddp"
            problems.append((("parallel",), why))
        if config.teacher.weights != "fp32":
            why = (
                "teacher.weights holds a language model's or encoder's teacher in a low precision; an image teacher "
                "keeps fp32 weights and computes at teacher_precision"
            )
            problems.append((("teacher", "weights"), why))
        if config.on_policy is not None:
            why = "on_policy has the student generate its training text: it is for language-model pairs"
            problems.append((("on_policy",), why))
        if config.teacher.mode == "topk_cache":
            why = (
                "teacher.mode topk_cache keeps a language model's top-k next tokens; an image pair takes live or cached"
            )
            problems.append((("teacher", "mode"), why))
        try:
            methods = check_method(config.method)
        except KdbenchError:
            return problems  # the plan reports the method itself
        encoder = [m.name for m in methods if m.cls.domain == "encoder"]
        if encoder:
            why = f"{', '.join(encoder)}: an encoder method; it distils BERT-shaped encoders: pair two encoders"
            return [*problems, (("method",), f"{why} (`kdbench list models`), not image classifiers")]
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

    def planned(self, config: Any) -> list[tuple[Measurement, int]]:
        out = [(Measurement.DISTILL_STEP, config.batch_size)]
        for bs in config.inference.batch_sizes:
            out.append((Measurement.STUDENT_INFERENCE, bs))
            if config.inference.teacher:
                out.append((Measurement.TEACHER_INFERENCE, bs))
        return out

    def build_pair(self, config: Any, backend: Any, cache: Any) -> tuple[nn.Module, nn.Module]:
        from kdbench.measure.cell import model_pair

        return model_pair(config, backend, cache)

    def batch(self, config: Any, batch_size: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kdbench.hw.data import synthetic_batch

        return synthetic_batch(config, batch_size, device, seed)

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: Any) -> Any:
        from kdbench.distill.hooks import resolve_paths

        return resolve_paths(teacher, student, example, config.features.teacher, config.features.student)

    def loss(self, config: Any, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Any) -> nn.Module:
        from kdbench.distill.losses import DistillLoss

        return DistillLoss(config, shapes)

    def step_columns(self, step: Any, config: Any, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]:
        from kdbench.measure.cell import _alignment_note, _layout, layout_note

        notes = (_alignment_note(x, config) or "", layout_note(config, x.device.type))
        return _layout(step.distiller.student, x, config), notes

    def measure(
        self,
        measurement: Measurement,
        batch_size: int,
        teacher: nn.Module,
        student: nn.Module,
        config: Any,
        backend: Any,
    ) -> Row:
        from kdbench.measure import cell

        role, model = ("student", student) if measurement == Measurement.STUDENT_INFERENCE else ("teacher", teacher)
        return cell.measure_inference(model, role, batch_size, config, backend)


VISION = Vision()
