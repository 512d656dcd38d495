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

One copy is counted where a row's attention takes it (``attention_path`` ``repeated``,
:mod:`kdbench.models.attention_path`): transformers' ``repeat_kv`` writes K and V × ``groups`` (query heads per kv
head) at every position the step attends, and SDPA reads that copy back (GPU review 4, M2).  A compiled static
decode step takes it (the static cache keeps a causal mask at one query token, which rules out SDPA's own GQA, and
under torch.compile transformers does not pack the query), over the cache's allocated length ``P + n``; a
dynamic cache that repeats, over the positions it holds.  Per generated token::

    repeat_kv_bytes_per_token = 2 × groups × kv_bytes_per_position × attended

(write and read back; the K and V read that makes the copy is the floor's own).  For Llama-3.1-8B in bf16 (groups
4, 128 KiB per position) at a 4,096-position static cache that is 4.3 GB per token, 34 GB per step at batch 8,
against a floor of about 20 GB per step.  Torch-free but for :func:`weight_bytes_read`, which walks a model's
parameters.
"""

from __future__ import annotations

from typing import Any


def _heads(config: Any) -> tuple[Any, int, int]:
    """The decoder's config of transformers ``config``, its query heads and kv heads (``num_key_value_heads``, else
    ``num_attention_heads``)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(config.num_attention_heads)
    return config, heads, int(getattr(config, "num_key_value_heads", None) or heads)


def kv_bytes_per_position(config: Any, itemsize: int) -> int:
    """Bytes of K and V one cached position holds over all layers of the model of transformers ``config``:
    ``2 × num_hidden_layers × kv_heads × head_dim × itemsize`` (kv_heads: ``num_key_value_heads``, else
    ``num_attention_heads``; head_dim: ``head_dim``, else ``hidden_size / num_attention_heads``)."""
    config, heads, kv_heads = _heads(config)
    layers = int(config.num_hidden_layers)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return 2 * layers * kv_heads * int(head_dim) * int(itemsize)


def kv_groups(config: Any) -> int:
    """Query heads per K and V head of the model of transformers ``config`` (1: multi-head attention)."""
    _, heads, kv_heads = _heads(config)
    return heads // kv_heads


def repeat_kv_bytes_per_token(kv_per_position: int, groups: int, attended: float) -> float:
    """The bytes transformers' ``repeat_kv`` adds per generated token where a decode step takes it: K and V written
    × ``groups`` at the ``attended`` positions of one sequence's cache, and read back by SDPA, ``2 × groups ×
    kv_per_position × attended`` (the module's docstring says why); 0 with one group (nothing repeated)."""
    if groups <= 1:
        return 0.0
    return 2 * groups * kv_per_position * attended


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
