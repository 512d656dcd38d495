"""The logits-sized buffers a loss implementation holds at its peak, from shapes alone: the
``logits_memory_bytes`` and ``logits_buffers`` columns of an LM step row."""

from __future__ import annotations

from typing import Any

from kdbench.core.errors import KdbenchError
from kdbench.distill.lm.divergences import TokenLoss
from kdbench.distill.lm.impls.base import get_impl

__all__ = ["logits_memory"]

_DTYPE_NAMES = {2: "16-bit", 4: "fp32", 8: "fp64"}


def logits_memory(
    impl: str,
    n_tokens: int,
    vocab: int,
    logits_dtype_bytes: int,
    chunk_size: int,
    loss: TokenLoss,
    n_valid: int | None = None,
) -> dict[str, Any]:
    """Estimated bytes of the logits-sized buffers `impl` holds at its peak, from shapes alone.

    Counts the (tokens, vocab) buffers (in the logits' dtype, and float32) and the (chunk, vocab)
    buffers alive at the peak of one forward + backward, over the ``n_valid`` tokens the loss counts for an
    implementation whose heads run on those alone (``LossImpl.valid_only``: every one but liger), else over
    all ``n_tokens`` (``n_valid`` None: every token valid); not the hidden states, the
    heads or their gradients, nor the allocator's slack.  The counts are each implementation's
    (``LossImpl.buffers``) and each divergence's (``Divergence.dense_fp32`` / ``chunk_fp32``), taken with a
    dispatch mode that tracks every storage.  Against the rise of VmHWM (forward KL + CE, 4096 tokens,
    V = 32000, chunk 1024, fp32; benchmarks/bench_lm_step_memory.py, 3 runs on a 2-core CPU), estimated
    / measured MiB: chunked 2375 / 2395-2492, fused_linear 875 / 812-844, liger 1281 / 1187-1362,
    torch_linear 1125 / 883-1074; the measurements include W_s's and h_s's gradients (70 MiB).  With masked
    tokens dense's buffers shrink to the valid rows, and chunked's and fused_linear's chunks walk the valid
    rows only.  A divergence that gives no count: ``bytes`` None, the text says what is not counted.

    Returns ``bytes``, ``buffers`` (how many (n_tokens, vocab) buffers), ``chunk_buffers`` (how many
    (chunk_rows, vocab) ones), ``chunk_rows`` and ``text``, e.g.
    ``"3 × 4096×32000 fp32 (logits, their gradient) + 7 × 1024×32000 fp32 (float32 work) = 2375 MiB"``.
    """
    found = get_impl(impl)
    if chunk_size < 1 or n_tokens < 0 or vocab < 1:
        raise KdbenchError(f"need chunk_size >= 1, n_tokens >= 0, vocab >= 1; got {chunk_size}, {n_tokens}, {vocab}")
    if n_valid is not None and found.valid_only:
        n_tokens = n_valid
    held = found.buffers(loss, n_tokens, chunk_size, logits_dtype_bytes)
    parts = [(c, b, what, n_tokens) for c, b, what in held.full]
    parts += [(c, b, what, held.rows) for c, b, what in held.chunk]
    unknown = [what for c, _, what, _ in parts if c is None]
    counted = [p for p in parts if p[0] is not None]
    total = int(sum(count * rows * vocab * nbytes for count, nbytes, _, rows in counted))
    words = [f"{c:g} × {rows}×{vocab} {_DTYPE_NAMES.get(b, f'{b}-byte')} ({what})" for c, b, what, rows in counted]
    if unknown:
        why = f"{loss.divergence}'s {', '.join(unknown)} not counted (its Divergence gives no buffer count)"
        return {
            "bytes": None,
            "buffers": None,
            "chunk_buffers": None,
            "chunk_rows": held.rows,
            "text": " + ".join(words + [why]),
        }
    return {
        "bytes": total,
        "buffers": sum(c for c, _, _ in held.full),
        "chunk_buffers": sum(c for c, _, _ in held.chunk),
        "chunk_rows": held.rows,
        "text": f"{' + '.join(words)} = {total / 2**20:.0f} MiB",
    }
