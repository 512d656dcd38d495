"""BERT-shaped encoders: teacher and student built from transformers' ``BertModel`` with random weights
(:mod:`kdbench.models.encoders`), distilled task-agnostically (``minilm``: their self-attention relations;
``hidden_mse``: their hidden states) on seeded token batches, served by forward latency.

The models.  Each is wrapped in :class:`~kdbench.models.encoders.Encoder`, whose forward is ids -> the last
hidden state (B, S, H); no MLM head, no labels.  The attention runs SDPA where the class has it (``minilm``
reads Q, K and V from hooks on the projections, so it needs no eager attention);
``overrides.*.attn_implementation: eager`` forces eager.  Every row says which one ran (``attn_implementation``).

The batch.  ``batch_size`` sequences of ``data.seq_len`` token ids, uniform over the vocabulary both models share,
from the cell's seed, every position attended (an all-ones attention mask).  The mask is not handed to the models:
an all-ones mask attends as no mask does, and transformers would check it on the host (``mask.all()``, a device
sync) at every forward.  The loss's targets are the ids, with -100 where a position is padding (none here): the
methods' mask is ``targets != -100``.  ``data.prompt_fraction`` and ``data.vocab_policy`` do not apply.

The loss (:class:`~kdbench.distill.encoder.EncoderLoss`).  The methods' terms, weighted, summed in float32 with
autocast off; no cross-entropy (there are no labels to distil with).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.names import Measurement
from kdbench.core.schema import Row
from kdbench.data.tokens import encoder_batch
from kdbench.distill.encoder import EncoderLoss
from kdbench.distill.losses import METHODS, check_method, check_weights, params_of
from kdbench.hw.backends import Backend, choose_autocast
from kdbench.measure.serving import token_serving_row
from kdbench.models import ModelCache
from kdbench.models.encoders import Encoder, build_encoder, check_encoder_name, encoder_config, is_encoder_model
from kdbench.models.lm import is_lm_model
from kdbench.models.meta import encoder_facts
from kdbench.workloads.base import (
    Pair,
    Problems,
    Workload,
    model_of,
    served_precision_note,
    serving_plan,
)
from kdbench.workloads.model_checks import facts_of, feature_problems, unused_features
from kdbench.workloads.placement import HostFootprint, ModelBuild, counted, fresh_model, pair_footprint, step_builds

DEFAULT_LAYERS = 4  # hidden_mse pairs at most this many encoder layers by default
ALSO_ON_ENCODERS = ("hidden_mse",)  # methods of another family's domain that run on encoder pairs too (hidden states)
ROLES = ("teacher", "student")


def qkv_paths(layers: list[str], index: int) -> list[str]:
    """The query, key and value projections of layer ``index`` (negative: from the end)."""
    from kdbench.distill.losses.minilm import PROJECTIONS

    return [f"{layers[index]}.attention.self.{p}" for p in PROJECTIONS]


def pair_attention(teacher: str, student: str) -> str:
    """The ``attn_implementation`` column: one name when both models ran the same."""
    return teacher if teacher == student else f"teacher {teacher}, student {student}"


def _configs(config: Any) -> dict[str, Any]:
    return {role: encoder_config(getattr(config.pair, role), getattr(config.overrides, role)) for role in ROLES}


# --------------------------------------------------------------------------- the workload


class EncoderWorkload(Workload):
    family = "encoder"
    a_pair = "an encoder pair"
    pairs = "encoder pairs"
    cell_defaults: ClassVar[dict[str, Any]] = {"data": {"kind": "tokens"}, "method": "hidden_mse"}
    takes = frozenset({"teacher.weights", "overrides"})

    # ------------------------------------------------------------------ plan time

    def check(self, config: CellConfig, allow_imports: bool) -> Problems:
        problems: Problems = []
        roles = []
        for role in ROLES:
            if is_encoder_model(getattr(config.pair, role)):
                roles.append(role)
            else:
                problems.append((("pair", role), _not_an_encoder(getattr(config.pair, role))))
        facts, built = facts_of(config, tuple(roles), self.family, allow_imports)
        problems += built
        configs = {role: f.config for role, f in facts.items()}
        if problems:
            return problems
        if config.data.kind != "tokens":
            return [(("data", "kind"), "an encoder pair needs token data: set data.kind: tokens (and seq_len)")]
        for role, c in configs.items():
            if config.data.seq_len > c.max_position_embeddings:
                problems.append(
                    (
                        ("data", "seq_len"),
                        f"data.seq_len {config.data.seq_len} is beyond the {role} {getattr(config.pair, role)}'s "
                        f"{c.max_position_embeddings} positions; lower it, or raise max_position_embeddings in "
                        f"overrides.{role}",
                    )
                )
        try:
            methods = check_method(config.method)
            check_weights(config.method, config.weights)
        except KdbenchError:
            return problems  # the plan reports the method itself
        other = [m.name for m in methods if m.cls.domain != "encoder" and m.name not in ALSO_ON_ENCODERS]
        if other:
            problems.append(
                (
                    ("method",),
                    f"{', '.join(other)}: not for encoder pairs (they distil classifier logits, feature maps or "
                    "next-token distributions); on an encoder pair use minilm or hidden_mse (`kdbench list methods`)",
                )
            )
            return problems
        feature = [m.name for m in methods if m.cls.needs_features]
        if len(feature) > 1:
            problems.append(
                (("method",), f"{'+'.join(feature)}: an encoder cell takes one feature method (they share the taps)")
            )
            return problems
        if "minilm" in feature:
            problems.extend(_minilm_problems(config, configs))
        elif feature:
            problems.extend(feature_problems(config, facts, DEFAULT_LAYERS, "encoder layers"))
        problems.extend(unused_features(config, methods))
        return problems

    def planned(self, config: CellConfig) -> list[tuple[Measurement, int]]:
        return serving_plan(config, (Measurement.STUDENT_INFERENCE,), (Measurement.TEACHER_INFERENCE,))

    def tokens(self, measurement: Measurement, batch_size: int, config: CellConfig) -> int | None:
        return batch_size * config.data.seq_len

    def config_columns(self, config: CellConfig) -> Row:
        return {"seq_len": config.data.seq_len}

    def model_overrides(self, config: CellConfig, role: str) -> dict[str, Any]:
        return dict(getattr(config.overrides, role))

    # ------------------------------------------------------------------ the step

    def build_pair(self, config: CellConfig, backend: Backend, cache: ModelCache) -> Pair:
        teacher, student = (self._model(config, b, backend, cache) for b in step_builds(config))
        return teacher, student

    def _model(self, config: CellConfig, build: ModelBuild, backend: Backend, cache: ModelCache) -> Encoder:
        name, overrides = getattr(config.pair, build.role), getattr(config.overrides, build.role)
        key = ("encoder", name, repr(sorted(overrides.items())), config.seed)
        return fresh_model(
            config,
            build,
            backend.device,
            cache,
            key,
            4 * encoder_counts(name, overrides)[0],
            lambda: build_encoder(name, overrides or None),
            lambda device, dtype: build_encoder(name, overrides or None, device=device, dtype=dtype),
            Encoder,
        )

    def host_footprint(self, config: CellConfig, device_type: str) -> HostFootprint:
        return pair_footprint(
            config,
            device_type,
            lambda role: encoder_counts(getattr(config.pair, role), getattr(config.overrides, role)),
        )

    def batch(
        self, config: CellConfig, batch_size: int, device: torch.device, seed: int, models: Pair
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = min(int(c.vocab_size) for c in _configs(config).values())
        return encoder_batch(batch_size, config.data.seq_len, vocab, seed, device, config.alignment)

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: CellConfig) -> Any:
        from kdbench.distill.hooks import FeaturePaths, layer_pairs

        if "minilm" in [m.name for m in check_method(config.method)]:
            p = params_of(config, METHODS["minilm"])
            return FeaturePaths(
                teacher=qkv_paths(teacher.layers(), p.teacher_layer),
                student=qkv_paths(student.layers(), p.student_layer),
            )
        given_t, given_s = config.features.teacher, config.features.student
        return layer_pairs(teacher.layers(), student.layers(), given_t, given_s, DEFAULT_LAYERS)

    def loss(
        self, config: CellConfig, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Backend
    ) -> nn.Module:
        return EncoderLoss(config, shapes, teacher, student)

    def step_columns(self, step: Any, config: CellConfig, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]:
        d = step.distiller
        row = Row(
            {
                "seq_len": config.data.seq_len,
                "data_ptr_mod64": x.data_ptr() % 64,
                "attn_implementation": pair_attention(d.teacher.attn_implementation, d.student.attn_implementation),
            }
        )
        return row, tuple(d.loss_fn.notes(x))

    # ------------------------------------------------------------------ serving

    def serve(
        self,
        measurement: Measurement,
        batch_size: int,
        pair: Pair,
        config: CellConfig,
        backend: Backend,
        budget_s: float | None,
    ) -> Row:
        _, model = model_of(measurement, pair)
        return measure_forward(self, measurement, model, batch_size, config, backend, budget_s)


ENCODER = EncoderWorkload()


def encoder_counts(name: str, overrides: dict[str, Any]) -> tuple[int, int]:
    """(parameters, elements of the largest) of encoder ``name`` with ``overrides``, from the plan's model on
    ``meta``."""
    return counted(encoder_facts(name, overrides), name)


def _not_an_encoder(name: str) -> str:
    from kdbench.models.registry import available_models

    if is_lm_model(name):
        return f"{name!r} is a causal language model; an encoder pair takes two encoders (`kdbench list models`)"
    if name in available_models():
        return f"{name!r} is an image classifier; an encoder pair takes two encoders (`kdbench list models`)"
    if ":" in name:
        return f"encoder pairs take registered encoders (`kdbench list models`), not the module:callable {name!r}"
    try:
        check_encoder_name(name)
    except KdbenchError as exc:
        return str(exc)
    raise AssertionError(f"{name!r} is an encoder")  # only called for names that are not


def _minilm_problems(config: Any, configs: dict[str, Any]) -> Problems:
    from kdbench.distill.losses.minilm import heads_problem

    p = config.minilm
    problems: Problems = []
    for role in ROLES:
        layers = int(configs[role].num_hidden_layers)
        index = getattr(p, f"{role}_layer")
        if not -layers <= index < layers:
            problems.append(
                (
                    ("minilm", f"{role}_layer"),
                    f"minilm.{role}_layer {index} is outside the {role}'s {layers} layers; use 0..{layers - 1} or "
                    "-1 (the last)",
                )
            )
    if config.features.teacher or config.features.student:
        why = "minilm taps the query/key/value projections of minilm.teacher_layer and student_layer: remove features"
        problems.append((("features",), why))
    t, s = configs["teacher"], configs["student"]
    why = heads_problem(t.num_attention_heads, s.num_attention_heads, t.hidden_size, s.hidden_size, p.relation_heads)
    if why:
        problems.append((("minilm", "relation_heads"), why))
    return problems


# --------------------------------------------------------------------------- serving


def measure_forward(
    workload: Workload,
    measurement: Measurement,
    model: Encoder,
    batch_size: int,
    config: CellConfig,
    backend: Backend,
    budget_s: float | None,
) -> Row:
    """The forward latency of the teacher or the student: eval(), inference_mode, the cell's precision, on a fixed
    batch of ``batch_size`` × ``data.seq_len`` ids over the model's own vocabulary; ``tokens_per_s`` counts its
    tokens."""
    vocab = int(model.config.vocab_size)  # the served model's own: its row depends on it alone (teacher reuse)
    ids, _ = encoder_batch(batch_size, config.data.seq_len, vocab, config.seed + 1, backend.device, config.alignment)
    choice = choose_autocast(backend, config.precision)
    model.eval()

    def call() -> Any:
        with torch.inference_mode(), choice.context(backend.device_type):
            return model(ids)

    columns = {"attn_implementation": model.attn_implementation}
    notes = (served_precision_note(measurement, config),)
    args = (workload, measurement, batch_size, config, backend, budget_s, choice, call, ids, columns, notes)
    return token_serving_row(*args)
