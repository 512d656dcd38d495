"""Which family a cell's pair belongs to, decided in one place, and what follows from it at plan time.

:func:`workload_of` decides the family once: BERT-shaped encoders when either model is a registered encoder,
causal language models when either is an LM (or the data is tokens), else image classifiers.  Nothing else
in kdbench tests ``data.kind`` or a family name to tell a family; it asks the workload.

:data:`FAMILY_SETTINGS` is the one table of settings only some families take, each with what it is for and
the message that refuses it elsewhere; each workload declares the keys it takes (:attr:`Workload.takes`) and
:func:`refusals` refuses the rest.  :func:`check_cell` is the plan's whole check of a cell (the family's own
checks, the refusals, the checks every cell has); :func:`expand_checked` is the suite's plan, checked
(:func:`kdbench.config.plan.expand` takes the check as an argument and stays below the families).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kdbench.config.plan import Cell, expand
from kdbench.config.schema import CellConfig, Suite
from kdbench.core.errors import KdbenchError
from kdbench.core.names import Measurement
from kdbench.distill.losses import check_method, check_weights
from kdbench.models.encoders import is_encoder_model
from kdbench.models.lm import is_lm_model
from kdbench.workloads.base import Problems, Workload
from kdbench.workloads.encoder import ENCODER
from kdbench.workloads.lm.workload import LM
from kdbench.workloads.vision import VISION

WORKLOADS: tuple[Workload, ...] = (VISION, LM, ENCODER)


def workload_of(config: CellConfig) -> Workload:
    """The cell's workload: encoders when either model is a registered encoder, language models when the pair is
    LMs or the data is tokens, else image classifiers (the checks report a pair that mixes families)."""
    if is_encoder_model(config.pair.teacher) or is_encoder_model(config.pair.student):
        return ENCODER
    if config.data.kind == "tokens" or is_lm_model(config.pair.teacher) or is_lm_model(config.pair.student):
        return LM
    return VISION


# --------------------------------------------------------------------------- settings of some families


@dataclass(frozen=True)
class FamilySetting:
    """A setting only some families take: where it sits, when a cell has set it, and the message that refuses it
    to another family (``{a_pair}`` and ``{pairs}`` name the refusing family's pairs, ``{value}`` is the setting's
    value; ``wording``: a family's own message where its advice differs)."""

    path: tuple[str, ...]
    is_set: Callable[[CellConfig], bool]
    refuse: str
    wording: dict[str, str] = field(default_factory=dict)

    def value(self, config: CellConfig) -> Any:
        node: Any = config
        for part in self.path:
            node = getattr(node, part)
        return node

    def message(self, config: CellConfig, workload: Workload) -> str:
        text = self.wording.get(workload.family, self.refuse)
        return text.format(a_pair=workload.a_pair, pairs=workload.pairs, value=self.value(config))


FSDP = "parallel fsdp shards language-model pairs decoder layer by decoder layer; "
SERVED = "inference.runtime {value} is for image classifiers: remove it"

FAMILY_SETTINGS: dict[str, FamilySetting] = {
    "parallel": FamilySetting(
        ("parallel",),
        lambda c: c.parallel == "fsdp",
        FSDP + "{a_pair} takes ddp",
        {"vision": FSDP + "image pairs take ddp"},
    ),
    "world_size": FamilySetting(
        ("world_size",),
        lambda c: c.world_size > 1,
        "{a_pair} runs on one device: set world_size: 1",
        {
            "encoder": "encoder pairs run on one device for now: parts of the student get no gradient (its pooler; "
            "with minilm its layers past the distilled attention), which DDP without find_unused_parameters rejects: "
            "set world_size: 1"
        },
    ),
    "teacher.weights": FamilySetting(
        ("teacher", "weights"),
        lambda c: c.teacher.weights != "fp32",
        "teacher.weights holds a language model's or encoder's teacher in a low precision; an image teacher keeps "
        "fp32 weights and computes at teacher_precision: remove it",
    ),
    "teacher.mode": FamilySetting(
        ("teacher", "mode"),
        lambda c: c.teacher.mode in ("topk_cache", "offline"),
        "teacher.mode topk_cache keeps a language model's top-k next tokens (and offline stores them); {a_pair} "
        "takes live or cached",
        {
            "encoder": "teacher.mode topk_cache keeps an LM's next tokens (and offline stores them); an encoder pair "
            "takes live or cached"
        },
    ),
    "on_policy": FamilySetting(
        ("on_policy",),
        lambda c: c.on_policy is not None,
        "on_policy has the student generate its training text: it is for language-model pairs; remove it",
        {"encoder": "on_policy has a causal LM generate its training text; not for encoders: remove it"},
    ),
    "loss_impl": FamilySetting(
        ("loss_impl",),
        lambda c: c.loss_impl != "dense",
        "loss_impl {value} computes LM heads and a token loss; {a_pair} has none: remove it",
    ),
    "chunk_size": FamilySetting(
        ("chunk_size",),
        lambda c: c.chunk_size != 1024,
        "chunk_size sets the chunks of a language model's loss_impl; {a_pair} has no token loss: remove it",
    ),
    "inference.decode_tokens": FamilySetting(
        ("inference", "decode_tokens"),
        lambda c: c.inference.decode_tokens != 32,
        "inference.decode_tokens is what a causal LM decodes when served; {a_pair} does not decode: remove it",
    ),
    "inference.speculative": FamilySetting(
        ("inference", "speculative"),
        lambda c: c.inference.speculative is not None,
        "inference.speculative has the teacher decode with the student as its draft: it is for language-model "
        "pairs, and {a_pair} does not decode: remove it",
    ),
    # token data only (image data leaves them out of the cell)
    "data.prompt_fraction": FamilySetting(
        ("data", "prompt_fraction"),
        lambda c: c.data.kind == "tokens" and c.data.prompt_fraction != 0.25,
        "data.prompt_fraction masks a causal LM's prompt tokens out of its loss; {a_pair} has no prompt: remove it",
    ),
    "data.vocab_policy": FamilySetting(
        ("data", "vocab_policy"),
        lambda c: c.data.kind == "tokens" and c.data.vocab_policy != "error",
        "data.vocab_policy reconciles two causal LMs' vocabularies; {a_pair} does not take it: remove it",
    ),
    "data.tokenizers": FamilySetting(
        ("data", "tokenizers"),
        lambda c: c.data.kind == "tokens" and c.data.tokenizers is not None,
        "data.tokenizers gives each causal LM its own tokenizer of real text; {a_pair} does not take it: remove it",
    ),
    "overrides": FamilySetting(
        ("overrides",),
        lambda c: bool(c.overrides.teacher or c.overrides.student),
        "overrides change a language model's or encoder's config; {a_pair}'s models are built by name: remove them",
    ),
    "inference.runtime": FamilySetting(
        ("inference", "runtime"),
        lambda c: c.inference.runtime != "eager",
        "{pairs} are served eagerly; " + SERVED,
        {"lm": "LM pairs are served eagerly (prefill and decode with transformers' KV cache); " + SERVED},
    ),
    "graphs": FamilySetting(
        ("graphs",),
        lambda c: c.graphs,
        "graphs replays an image classifier's forward; {pairs} do not take it: remove it",
    ),
    "generation": FamilySetting(
        ("generation",),
        lambda c: c.generation.cache != "dynamic" or c.generation.compile,
        "generation sets how a causal LM decodes (its KV cache, a compiled decode step); {a_pair} does not "
        "decode: remove it",
    ),
    "pad_to": FamilySetting(
        ("pad_to",),
        lambda c: c.pad_to != 1,
        "pad_to pads a classifier's width; {a_pair} has no classifier: remove it",
        {
            "lm": "pad_to pads a classifier's width; on an LM pair set overrides.*.vocab_size instead",
            "encoder": "pad_to pads a classifier's width; an encoder has no classifier: remove it",
        },
    ),
}


def refusals(workload: Workload, config: CellConfig) -> Problems:
    """The settings the cell sets that its family does not take, as (setting path, message)."""
    unknown = set(workload.takes) - set(FAMILY_SETTINGS)
    if unknown:
        raise AssertionError(f"{type(workload).__name__}.takes names settings the table lacks: {sorted(unknown)}")
    return [
        (setting.path, setting.message(config, workload))
        for key, setting in FAMILY_SETTINGS.items()
        if key not in workload.takes and setting.is_set(config)
    ]


# --------------------------------------------------------------------------- the plan


def check_cell(config: CellConfig, allow_imports: bool, nnodes: int = 1) -> Problems:
    """What cannot run in a cell, as (setting path, message): what the pair's workload finds (unknown models,
    inputs a model cannot take, feature paths it lacks, a method of another family, ...:
    :meth:`Workload.check`), the settings of other families it sets (:func:`refusals`), unknown methods and
    impossible rank layouts."""
    workload = workload_of(config)
    problems = workload.check(config, allow_imports) + refusals(workload, config)
    if config.teacher.weights not in ("fp32", config.teacher_precision):
        w = config.teacher.weights
        why = f"teacher.weights {w} computes the teacher in {w}: set teacher_precision: {w} (or teacher.weights: fp32)"
        problems.append((("teacher", "weights"), why))
    if config.parallel == "fsdp" and config.world_size == 1:
        why = "parallel fsdp shards the pair over ranks: set world_size to 2 or more (or parallel: ddp)"
        problems.append((("parallel",), why))
    problems.extend(fsdp_problems(config))
    if config.world_size > 1 and config.world_size % nnodes:
        why = f"world_size {config.world_size} does not split over launcher.nnodes {nnodes}; use a multiple of nnodes"
        problems.append((("world_size",), why))
    try:
        check_method(config.method)
    except KdbenchError as exc:
        problems.append((("method",), str(exc)))
    try:
        check_weights(config.method, config.weights)
    except KdbenchError as exc:
        problems.append((("weights",), str(exc)))
    return problems


def fsdp_problems(config: CellConfig) -> Problems:
    """``fsdp.param_dtype`` / ``fsdp.reduce_dtype`` (FSDP2's MixedPrecisionPolicy): for ``parallel: fsdp`` cells
    only, and a param_dtype only where the models compute in it as the cell says (a bf16 all-gather computes in
    bf16, whatever ``precision`` claims) and where it does not upcast a teacher held in a low precision."""
    fsdp = config.fsdp
    given = [key for key in ("param_dtype", "reduce_dtype") if getattr(fsdp, key) is not None]
    if given and config.parallel != "fsdp":
        return [
            (
                ("fsdp", key),
                f"fsdp.{key} is FSDP2's mixed precision and this cell is not sharded: remove it (or set parallel: "
                "fsdp)",
            )
            for key in given
        ]
    param = fsdp.param_dtype
    if param in ("bf16", "fp16"):
        wrong = [key for key in ("precision", "teacher_precision") if getattr(config, key) != param]
        if wrong:
            fix = " and ".join(f"{key}: {param}" for key in wrong)
            why = f"fsdp.param_dtype {param} gathers and computes both models in {param}: set {fix}"
            why += " (or fsdp.param_dtype: null)"
            return [(("fsdp", "param_dtype"), why)]
    if param == "fp32" and config.teacher.weights != "fp32":
        held = config.teacher.weights
        why = (
            f"fsdp.param_dtype fp32 would gather the teacher held in {held} (teacher.weights) upcast to fp32: set "
            f"fsdp.param_dtype: {held} or null"
        )
        return [(("fsdp", "param_dtype"), why)]
    return []


def expand_checked(suite: Suite) -> list[Cell]:
    """The suite's cells (:func:`kdbench.config.plan.expand`), each checked by :func:`check_cell`."""
    return expand(suite, check_cell)


def planned_measurements(config: CellConfig) -> list[tuple[Measurement, int]]:
    """(measurement, batch_size) of every row a cell produces, in order (its workload's plan)."""
    return workload_of(config).planned(config)
