"""The causal LMs kdbench builds by name (a data table): the numbers of each checkpoint's published
``config.json``.

The numbers below are those of the Hugging Face ``config.json`` of each checkpoint
(``meta-llama/Llama-3.1-8B``, ``meta-llama/Llama-3.2-1B``, ``meta-llama/Llama-3.2-3B``,
``Qwen/Qwen2.5-0.5B``, ``Qwen/Qwen2.5-1.5B``, ``Qwen/Qwen2.5-7B``, ``gpt2``,
``gpt2-medium``), the fields that decide the shapes and the position encoding.  The
parameter counts they give (:func:`kdbench.models.lm.lm_parameter_count`) equal the published ones.
Llama's ``head_dim`` is left out: it is derived as ``hidden_size //
num_attention_heads``, which equals the published value (64 for 1B, 128 for 3B and 8B)
and follows an override of ``hidden_size``.
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}


def _llama(**numbers: Any) -> dict[str, Any]:
    base = {
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    return {"config_class": "LlamaConfig", "config": {**base, **numbers}}


def _qwen2(**numbers: Any) -> dict[str, Any]:
    # Qwen2 has a bias on q/k/v (not on o_proj): Qwen2Attention always builds it, there is
    # no config field for it.
    base = {
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    }
    return {"config_class": "Qwen2Config", "config": {**base, **numbers}}


def _gpt2(**numbers: Any) -> dict[str, Any]:
    base = {
        "vocab_size": 50257,
        "n_positions": 1024,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    }
    return {"config_class": "GPT2Config", "config": {**base, **numbers}}


def _tiny_llama(**numbers: Any) -> dict[str, Any]:
    base = {
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return {"config_class": "LlamaConfig", "config": {**base, **numbers}}


# name -> {"config_class": transformers config class name, "config": its numbers}
LM_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _llama(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
    ),
    "llama-3.2-1b": _llama(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
    ),
    "llama-3.2-3b": _llama(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
    ),
    "qwen2.5-0.5b": _qwen2(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": _qwen2(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _qwen2(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "gpt2": _gpt2(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": _gpt2(n_embd=1024, n_layer=24, n_head=16),
    "tiny-llama-teacher": _tiny_llama(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "tiny-llama-student": _tiny_llama(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
}
