"""The model catalogue, served once: every family of model kdbench builds by name, its models, and their
parameter counts.  ``kdbench list models`` prints it and :mod:`kdbench.docgen` writes it into the docs.

Families: the image classifiers of the registry (``cifar``, ``torchvision``, ``toy``: :mod:`.registry`), causal
language models (``lm``: :mod:`.lm`) and BERT-shaped encoders (``encoder``: :mod:`.encoders`).  Image classifiers
are counted as the cell defaults build them (their head follows ``data.num_classes``), torchvision's for
ImageNet; LMs and encoders as registered.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from kdbench.models.registry import FAMILIES, available_models, parameter_count

TORCHVISION_CLASSES = 1000  # torchvision's classifiers are counted as ImageNet builds them
TORCHVISION_SHAPE = (3, 224, 224)

FAMILY_NOTES = {
    "lm": "causal language models built from transformers' classes with random weights (the `lm` extra), for cells "
    "with `data.kind: tokens`; tied embeddings counted once. A local `config.json` path names one too, and "
    "`hf:ORG/NAME` one whose `config.json` is in the local Hugging Face cache (never downloaded).",
    "encoder": "BERT-shaped encoders (transformers' `BertModel`: embeddings, layers, pooler; no MLM head) with random "
    "weights (the `lm` extra), for `minilm` and `hidden_mse` cells with `data.kind: tokens`; `hf:ORG/NAME` names one "
    "whose `config.json` (`model_type: bert`) is in the local Hugging Face cache",
}
TITLES = {  # what each family is, in a few words
    "cifar": "CIFAR classifiers of the distillation literature",
    "torchvision": "ImageNet classifiers of the installed torchvision",
    "toy": "a toy classifier",
    "lm": "causal language models (data.kind: tokens)",
    "encoder": "BERT-shaped encoders (data.kind: tokens)",
}
CALLABLE_NOTE = "`module:callable`: a user's own model factory (needs `allow_imports: true` or `--allow-imports`)"
CONFIG_JSON_NOTE = (
    "`config.json`: a local transformers config (its model_type a causal LM) as a model name; `hf:ORG/NAME`: the same "
    "read from the local Hugging Face cache (HF_HOME; never downloaded)"
)


@dataclass(frozen=True)
class Family:
    name: str
    models: tuple[str, ...]  # natural order (resnet8 < resnet14 < resnet110)
    num_classes: int | None = None  # image classifiers: the classes and input they are counted at (else: as
    shape: tuple[int, ...] | None = None  # registered)

    @property
    def title(self) -> str:
        return TITLES.get(self.name, self.name)

    def parameters(self, name: str) -> int:
        """Parameters of model ``name`` of this family (built on the meta device where it can be)."""
        if self.name == "lm":
            from kdbench.models.lm import lm_parameter_count

            return lm_parameter_count(name)
        if self.name == "encoder":
            from kdbench.models.encoders import encoder_parameter_count

            return encoder_parameter_count(name)
        return parameter_count(name, self.num_classes, self.shape)

    def tokens(self, name: str) -> tuple[int, int | None] | None:
        """A token model's vocabulary size and positions (``max_position_embeddings``: the longest ``seq_len`` it
        takes; None where its config sets none); None for an image classifier."""
        if self.name == "lm":
            from kdbench.models.lm import lm_config, max_positions

            config = lm_config(name)
        elif self.name == "encoder":
            from kdbench.models.encoders import encoder_config
            from kdbench.models.lm import max_positions

            config = encoder_config(name)
        else:
            return None
        return int(config.vocab_size), max_positions(config)


def tokens_text(tokens: tuple[int, int | None]) -> str:
    """``vocabulary 128,256, positions 131,072``: what one needs to pick a ``seq_len`` (at most the positions)."""
    vocab, positions = tokens
    return f"vocabulary {vocab:,}, positions {positions:,}" if positions else f"vocabulary {vocab:,}, positions unset"


def natural(name: str) -> list:
    """resnet8 < resnet14 < resnet110: digit runs compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def families(num_classes: int, shape: tuple[int, ...]) -> Iterator[Family]:
    """Every family, image classifiers first (counted at ``num_classes`` and ``shape``, the cell defaults;
    torchvision's for ImageNet), then LMs and encoders (as registered)."""
    from kdbench.models.encoders import ENCODER_CONFIGS
    from kdbench.models.lm import LM_CONFIGS

    registered = available_models()
    for family in FAMILIES:
        names = tuple(sorted((n for n, f in registered.items() if f == family), key=natural))
        if family == "torchvision":
            yield Family(family, names, TORCHVISION_CLASSES, TORCHVISION_SHAPE)
        else:
            yield Family(family, names, num_classes, tuple(shape))
    yield Family("lm", tuple(LM_CONFIGS))
    yield Family("encoder", tuple(ENCODER_CONFIGS))
