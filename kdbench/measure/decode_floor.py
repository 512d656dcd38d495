"""Decode against its floor: the bytes one generated token must read, from which its memory-bandwidth floor follows.

Decoding is memory-bound: each step multiplies one token per sequence by every weight matrix, so it does
about 2 FLOPs per weight it reads, far below any device's FLOPs-per-byte balance point, and its time is set by
the bytes it reads (the roofline model: Williams, Waterman and Patterson, "Roofline", CACM 2009; for LLM decode,
e.g. Kipply's "Transformer inference arithmetic", 2022, and Pope et al., "Efficiently scaling transformer
inference", 2022).  A decode step of a batch of B sequences whose cache holds L positions reads

* the weights once, whatever B: every parameter in the dtype it is stored in, except the input embedding tables
  (token and learned position), of which only the B looked-up rows are read (a table tied to the LM head is read
  whole, as the head);
* the KV cache of every layer at the positions it holds: ``2 (K and V) × layers × kv_heads × head_dim ×
  bytes per element × L`` per sequence.

Over a call that generates ``n`` tokens from a ``P``-token prompt, step ``t`` (0 .. n − 1) attends over
``P + t`` cached positions, ``P + (n − 1) / 2`` on average, so per generated token (B per step)::

    decode_bytes_per_token = weight_bytes / B + kv_bytes_per_position × (P + (n − 1) / 2)

The floor time per token is that over the device's bandwidth, and a row's share of the floor is
``decode_bytes_per_token × tokens_per_s / bandwidth`` (:mod:`kdbench.store.derived`).  It is a floor: the
activations, the new K/V written, the logits (B × vocab) and the sampling are left out, as is what a kernel
re-reads; a static cache's attention reads its whole allocated length each step (masked), more than the
floor counts.  Sliding-window layers are counted as full ones (an upper bound on what they must read).
Torch-free but for :func:`weight_bytes_read`, which walks a model's parameters.
"""

from __future__ import annotations

from typing import Any


def kv_bytes_per_position(config: Any, itemsize: int) -> int:
    """Bytes of K and V one cached position holds over all layers of the model of transformers ``config``:
    ``2 × num_hidden_layers × kv_heads × head_dim × itemsize`` (kv_heads: ``num_key_value_heads``, else
    ``num_attention_heads``; head_dim: ``head_dim``, else ``hidden_size / num_attention_heads``)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return 2 * layers * kv_heads * int(head_dim) * int(itemsize)


def decode_bytes_per_token(
    weight_bytes: int, kv_per_position: int, batch_size: int, prompt_len: int, new_tokens: int
) -> float:
    """The bytes a decode call must read per generated token: ``weight_bytes / batch_size + kv_per_position ×
    (prompt_len + (new_tokens − 1) / 2)`` (the module's docstring says why)."""
    if batch_size < 1 or new_tokens < 1 or prompt_len < 0:
        raise ValueError(f"batch_size {batch_size} and new_tokens {new_tokens} must be >= 1, prompt_len >= 0")
    return weight_bytes / batch_size + kv_per_position * (prompt_len + (new_tokens - 1) / 2)


def weight_bytes_read(lm: Any) -> int:
    """The bytes of ``lm``'s parameters a decode step reads, in their stored dtypes: each parameter once (tied
    ones once), less the input embedding tables (``nn.Embedding`` modules, of which a step reads one row per
    sequence) unless a table is also the LM head's weight."""
    from torch import nn

    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    tables = {id(m.weight) for m in lm.modules() if isinstance(m, nn.Embedding) and m.weight is not head_weight}
    seen: set[int] = set()
    total = 0
    for p in lm.parameters():  # parameters() yields a tied tensor once
        if id(p) in seen or id(p) in tables:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def model_decode_bytes_per_token(lm: Any, itemsize: int, batch_size: int, prompt_len: int, new_tokens: int) -> float:
    """:func:`decode_bytes_per_token` of transformers causal LM ``lm`` (its weights as stored, its config's KV
    shape) with a KV cache of ``itemsize``-byte elements."""
    kv = kv_bytes_per_position(lm.config, itemsize)
    return decode_bytes_per_token(weight_bytes_read(lm), kv, batch_size, prompt_len, new_tokens)
