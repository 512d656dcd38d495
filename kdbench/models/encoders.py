"""BERT-shaped encoders for distillation, with random weights (issue 24's encoder pairs).

The shapes MiniLM (Wang et al. 2020) distils, held as the numbers of their published ``config.json`` files and
built as Hugging Face ``transformers`` ``BertModel`` s (embeddings, encoder layers and the pooler; no MLM head)
with random weights: nothing is downloaded, no hub is reached.  ``hf:ORG/NAME`` names a BERT whose ``config.json``
is in the local Hugging Face cache (:mod:`kdbench.models.hub`).

- ``bert-base`` and ``bert-large``: ``google-bert/bert-base-uncased`` and ``bert-large-uncased`` (12 layers × 768,
  12 heads, 3072 FFN; 24 × 1024, 16 heads, 4096 FFN; vocabulary 30,522; 512 positions).  ``bert-base`` has
  109,482,240 parameters, the published 109.5 M of ``BertModel`` (tested).
- ``minilm-l12-h384`` and ``minilm-l6-h384``: MiniLM's published students (``microsoft/MiniLM-L12-H384-uncased``
  and its 6-layer sibling): 12 or 6 layers × 384, 12 heads, 1536 FFN, BERT's vocabulary.
- ``tiny-bert-teacher`` (4 layers × 128, 4 heads) and ``tiny-bert-student`` (2 × 64, 4 heads), vocabulary 2,048,
  for the CPU and the tests.

``overrides`` set any ``BertConfig`` field (checked as :mod:`kdbench.models.lm` checks an LM's), and one more
key, ``attn_implementation`` (``sdpa`` or ``eager``): the attention the model runs.  By default it is SDPA where
the class has it (``BertModel`` does), eager otherwise.

:class:`Encoder` wraps a built encoder for distillation: its forward is ids -> the last hidden state.

``transformers`` is imported only inside the functions (the ``lm`` extra).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.models.hub import cached_config, is_hf_name

ATTN_KEY = "attn_implementation"  # the override that is not a config field: the attention the model runs
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _bert(**numbers: Any) -> dict[str, Any]:
    base = {
        "vocab_size": 30522,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "layer_norm_eps": 1e-12,
        "initializer_range": 0.02,
        "pad_token_id": 0,
    }
    return {**base, **numbers}


# name -> BertConfig numbers
ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "bert-base": _bert(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": _bert(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "minilm-l12-h384": _bert(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536),
    "minilm-l6-h384": _bert(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "tiny-bert-teacher": _bert(
        vocab_size=2048, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512
    ),
    "tiny-bert-student": _bert(
        vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256
    ),
}


def is_encoder_model(name: Any) -> bool:
    """A registered encoder's name, or ``hf:ORG/NAME`` whose config in the local Hugging Face cache is a BERT's
    (``model_type: bert``; :mod:`kdbench.models.hub`)."""
    if is_hf_name(name):
        return (cached_config(name) or {}).get("model_type") == "bert"
    return isinstance(name, str) and name in ENCODER_CONFIGS


def check_encoder_name(name: str) -> dict[str, Any]:
    if is_hf_name(name) and is_encoder_model(name):  # the cached config's fields
        return {k: v for k, v in (cached_config(name) or {}).items() if k != "model_type"}
    if not is_encoder_model(name):
        hint = did_you_mean(str(name), ENCODER_CONFIGS)
        raise KdbenchError(f"unknown encoder {name!r}; {hint}known: {', '.join(ENCODER_CONFIGS)}")
    return ENCODER_CONFIGS[name]


def _split(overrides: dict[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """The config fields of ``overrides``, and the attention implementation it asks for (None: the default)."""
    fields = dict(overrides or {})
    attn = fields.pop(ATTN_KEY, None)
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        raise KdbenchError(
            f"override {ATTN_KEY}: {attn!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)} (the attention the "
            "encoder runs)"
        )
    return fields, attn


def encoder_config(name: str, overrides: dict[str, Any] | None = None):
    """The ``transformers.BertConfig`` of encoder ``name`` with ``overrides`` (any config field, e.g.
    ``{"num_hidden_layers": 2}``; ``attn_implementation`` is not a field and is left out here)."""
    from kdbench.models.config_checks import check_config_fields
    from kdbench.models.lm import config_class_named

    numbers = check_encoder_name(name)
    fields, _ = _split(overrides)
    config_class = config_class_named("BertConfig")
    check_config_fields(config_class, fields, f"override for {name}")
    config = config_class(**{**copy.deepcopy(numbers), **fields})
    heads = config.num_attention_heads
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise KdbenchError(f"override for {name}: num_attention_heads {heads!r} must be a whole number, at least 1")
    if config.hidden_size % config.num_attention_heads:
        raise KdbenchError(
            f"override for {name}: hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
            f"{config.num_attention_heads}"
        )
    return config


def attn_implementation(name: str, overrides: dict[str, Any] | None = None) -> str:
    """The attention implementation encoder ``name`` is built with: the override's, else SDPA where the class has
    it (``BertModel`` does), else eager."""
    from kdbench.models.lm import transformers_module

    _, attn = _split(overrides)
    if attn is not None:
        return attn
    return "sdpa" if getattr(transformers_module().BertModel, "_supports_sdpa", False) else "eager"


def build_encoder(
    name: str,
    overrides: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The ``BertModel`` of encoder ``name`` with random weights, built directly on ``device`` (``"meta"``
    allocates nothing) in ``dtype``, in eval mode, with :func:`attn_implementation`'s attention."""
    from kdbench.models.lm import from_config, transformers_module

    kwargs = {"attn_implementation": attn_implementation(name, overrides)}
    return from_config(transformers_module().AutoModel, encoder_config(name, overrides), kwargs, dtype, device)


def encoder_parameter_count(name: str, overrides: dict[str, Any] | None = None) -> int:
    """Parameters of the encoder, built on the meta device (no memory)."""
    model = build_encoder(name, overrides, device="meta")
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class Encoder(nn.Module):
    """A transformers encoder whose forward is ids (and an optional attention mask) -> the last hidden state."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    @property
    def config(self):
        return self.bert.config

    @property
    def heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def attn_implementation(self) -> str:
        return str(self.config._attn_implementation)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def layers(self) -> list[str]:
        """Module paths of the encoder layers, in order."""
        return [f"bert.encoder.layer.{i}" for i in range(len(self.bert.encoder.layer))]
