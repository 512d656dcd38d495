"""Language models a suite names as ``module:callable`` (tests of the LM workload's imports)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_hf_student() -> nn.Module:
    """A transformers causal LM, as a user's factory would return it."""
    from kdbench.models.lm import build_lm

    return build_lm("tiny-llama-student", {"num_hidden_layers": 1})


class IdsToLogits(nn.Module):
    """Not a transformers model: token ids in, logits out (vocabulary 4096, as the tiny Llamas)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 32)
        self.out = nn.Linear(32, 4096)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids)))


def body_only() -> nn.Module:
    """A transformers decoder without its LM head (``AutoModel``, not ``...ForCausalLM``): hidden states out."""
    from kdbench.models.lm import lm_config, transformers_module

    return transformers_module().AutoModel.from_config(lm_config("tiny-llama-student", {"num_hidden_layers": 1}))


def from_the_hub() -> nn.Module:
    """A user's factory that downloads its model (a repository that does not exist)."""
    from kdbench.models.lm import transformers_module

    return transformers_module().AutoModelForCausalLM.from_pretrained("kdbench-tests/no-such-model")
