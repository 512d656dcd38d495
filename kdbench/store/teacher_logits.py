"""The encodings of an offline teacher's top-k next-token log-probabilities: arrays <-> bytes, numpy only.

One token's entry is fixed-size, so a shard of n tokens is ``n × bytes_per_token`` bytes before compression and a
token's bytes are found by arithmetic (random access by row, no index):

  values    k log-probabilities: ``fp16`` or ``bf16`` (2 bytes each), or ``int8`` (1 byte each, with a per-row
            offset and scale in float32: 8 bytes a token; code c means offset − c × scale, code 255 is −inf)
  indices   their vocabulary ids: ``int32`` (4 bytes), ``int16`` (2 bytes, read as unsigned: V ≤ 65,536) or
            ``packed17`` (17 bits each, Megatron-LM's packing, V ≤ 131,072: ceil(17k / 8) bytes a token)
  rest      the log of the mass outside the kept entries, float32 (4 bytes; −inf when they hold it all)

so ``bytes_per_token = k × value_bytes + (8 if int8) + index_bytes(k) + 4``.  A top-p cut keeps, per token, the
fewest entries whose mass reaches ``top_p`` (at most k): the slots after the cut hold −inf and repeat the last kept
id, so the row keeps its size and a loss that scatters ids sees each kept id once; the rest's mass takes what was
cut.  A shard's sections are the
rows' values, then (int8) their offsets and scales, then the indices, then the rests, each contiguous.

``compression`` ``none`` writes those bytes as they are (a reader takes any rows with positioned reads);
``zstd:<level>`` compresses the shard whole with pyarrow's zstd codec (Python 3.11 has no zstd of its own), read
back whole.  Why this format (against safetensors and Parquet): docs/lm.md, "Offline teacher stores".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from kdbench.core.errors import KdbenchError

VALUES = ("fp16", "bf16", "int8")
INDICES = ("auto", "int32", "int16", "packed17")
INDEX_LIMITS = {"int32": 1 << 31, "int16": 1 << 16, "packed17": 1 << 17}
INT8_NEG_INF = 255  # the int8 code of a slot after a top-p cut


def parse_compression(text: str) -> tuple[str, int | None]:
    """``none`` or ``zstd:<level>`` (level 1..22) as (codec, level); ValueError names the forms."""
    text = str(text).strip()
    if text == "none":
        return "none", None
    if text.startswith("zstd:") and text[5:].isdigit() and 1 <= int(text[5:]) <= 22:
        return "zstd", int(text[5:])
    raise ValueError(f"compression is none or zstd:<level> with a level in 1..22 (e.g. zstd:3), got {text!r}")


@dataclass(frozen=True)
class Encoding:
    """How a store encodes each token's top-k (see the module's docstring)."""

    k: int
    values: str = "fp16"
    indices: str = "int32"  # resolved: never "auto" here (:func:`resolve_indices`)
    compression: str = "none"
    top_p: float | None = None

    @property
    def value_bytes(self) -> int:
        return 1 if self.values == "int8" else 2

    @property
    def index_bytes(self) -> int:
        """Bytes of one token's k indices."""
        if self.indices == "packed17":
            return math.ceil(17 * self.k / 8)
        return self.k * (4 if self.indices == "int32" else 2)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's entry before compression: the format's arithmetic."""
        return self.k * self.value_bytes + (8 if self.values == "int8" else 0) + self.index_bytes + 4

    @property
    def label(self) -> str:
        """E.g. ``k32 fp16 int16 zstd:3 top_p 0.95``: the row's ``teacher_store_encoding``."""
        cut = f" top_p {self.top_p:g}" if self.top_p is not None else ""
        return f"k{self.k} {self.values} {self.indices} {self.compression}{cut}"

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_indices(indices: str, vocab: int) -> str:
    """``auto``: int16 where the vocabulary fits 16 unsigned bits, else int32; a named packing that cannot hold
    ``vocab`` ids raises KdbenchError."""
    if indices == "auto":
        return "int16" if vocab <= INDEX_LIMITS["int16"] else "int32"
    if vocab > INDEX_LIMITS[indices]:
        raise KdbenchError(
            f"teacher.indices {indices} holds ids below {INDEX_LIMITS[indices]}, and the vocabulary has {vocab} "
            "entries: use int32 (or auto)"
        )
    return indices


def top_p_cut(logp: np.ndarray, indices: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows of descending top-k log-probs cut after the fewest entries whose mass reaches ``top_p``: later slots
    −inf, their ids the last kept one's."""
    mass = np.cumsum(np.exp(logp.astype(np.float64)), axis=-1)
    keep = np.minimum((mass < top_p).sum(axis=-1) + 1, logp.shape[-1])  # entries kept per row, >= 1
    cut = np.arange(logp.shape[-1])[None, :] >= keep[:, None]
    last = np.take_along_axis(indices, (keep - 1)[:, None], axis=-1)
    return np.where(cut, -np.inf, logp).astype(logp.dtype), np.where(cut, last, indices)


def _pack17(ids: np.ndarray) -> np.ndarray:
    """(n, k) ids below 2^17 as (n, ceil(17k/8)) bytes: each id's 17 bits, most significant first, row by row."""
    n, k = ids.shape
    bits = ((ids[:, :, None].astype(np.uint32) >> np.arange(16, -1, -1, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(n, 17 * k), axis=-1)


def _unpack17(raw: np.ndarray, k: int) -> np.ndarray:
    n = raw.shape[0]
    bits = np.unpackbits(raw, axis=-1, count=17 * k).reshape(n, k, 17).astype(np.int32)
    return (bits << np.arange(16, -1, -1, dtype=np.int32)).sum(axis=-1, dtype=np.int32)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 → bfloat16's 16 bits, rounded to nearest even (as torch's ``.to(torch.bfloat16)``)."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    nan = np.isnan(values)
    return np.where(nan, 0x7FC0, rounded >> 16).astype(np.uint16)


def encode(enc: Encoding, logp: np.ndarray, indices: np.ndarray, rest: np.ndarray) -> bytes:
    """One shard's bytes before compression: ``logp`` (n, k) float32 descending, ``indices`` (n, k), ``rest`` (n,)."""
    n = logp.shape[0]
    if enc.top_p is not None:  # the entries cut go to the rest's bucket
        logp, indices = top_p_cut(logp, indices, enc.top_p)
        kept = np.exp(logp.astype(np.float64)).sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rest = np.where(kept < 1, np.log1p(-np.minimum(kept, 1)), -np.inf).astype(np.float32)
    parts: list[np.ndarray] = []
    if enc.values == "fp16":
        parts.append(logp.astype(np.float16))
    elif enc.values == "bf16":
        parts.append(_bf16_bits(logp))
    else:
        finite = np.isfinite(logp)
        top = logp[:, 0].astype(np.float32)  # the largest: rows are descending
        low = np.where(finite, logp, np.inf).min(axis=-1).astype(np.float32)
        scale = np.maximum((top - low) / (INT8_NEG_INF - 1), np.float32(1e-30)).astype(np.float32)
        codes = np.rint((top[:, None] - np.where(finite, logp, top[:, None])) / scale[:, None])
        codes = np.where(finite, np.clip(codes, 0, INT8_NEG_INF - 1), INT8_NEG_INF).astype(np.uint8)
        parts += [codes, np.stack([top, scale], axis=-1)]
    if enc.indices == "packed17":
        parts.append(_pack17(indices))
    else:
        parts.append(indices.astype(np.int32 if enc.indices == "int32" else np.uint16))
    parts.append(rest.astype(np.float32))
    out = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    assert len(out) == n * enc.bytes_per_token, (len(out), n, enc)
    return out


def section_offsets(enc: Encoding, n: int) -> dict[str, tuple[int, int]]:
    """Each section's (start, bytes per row) in a shard of ``n`` tokens: rows r..r+m of a section are the bytes
    ``start + r × per_row`` for ``m × per_row``."""
    sizes = [("values", enc.k * enc.value_bytes)]
    if enc.values == "int8":
        sizes.append(("scales", 8))
    sizes += [("indices", enc.index_bytes), ("rest", 4)]
    out, start = {}, 0
    for name, per_row in sizes:
        out[name] = (start, per_row)
        start += n * per_row
    return out


def decode_sections(enc: Encoding, sections: dict[str, bytes], m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logp, indices, rest) of ``m`` rows from their sections' bytes: logp float16 (fp16), uint16 bits
    (bf16, the caller views them as bfloat16) or float32 (int8, dequantized); indices int32; rest float32."""
    k = enc.k
    raw = sections["values"]
    if enc.values == "fp16":
        logp = np.frombuffer(raw, dtype=np.float16).reshape(m, k)
    elif enc.values == "bf16":
        logp = np.frombuffer(raw, dtype=np.uint16).reshape(m, k)
    else:
        codes = np.frombuffer(raw, dtype=np.uint8).reshape(m, k)
        top, scale = np.frombuffer(sections["scales"], dtype=np.float32).reshape(m, 2).T
        logp = np.where(codes == INT8_NEG_INF, -np.inf, top[:, None] - codes.astype(np.float32) * scale[:, None])
        logp = logp.astype(np.float32)
    idx_raw = sections["indices"]
    if enc.indices == "packed17":
        indices = _unpack17(np.frombuffer(idx_raw, dtype=np.uint8).reshape(m, enc.index_bytes), k)
    else:
        indices = np.frombuffer(idx_raw, dtype=np.int32 if enc.indices == "int32" else np.uint16).reshape(m, k)
        indices = indices.astype(np.int32)
    rest = np.frombuffer(sections["rest"], dtype=np.float32).reshape(m)
    return logp, indices, rest


def decode(enc: Encoding, data: bytes, n: int, start: int = 0, m: int | None = None):
    """Rows ``start .. start + m`` of a shard of ``n`` tokens from its whole (decompressed) bytes."""
    m = n - start if m is None else m
    view = memoryview(data)
    sections = {
        name: view[offset + start * per_row : offset + (start + m) * per_row]
        for name, (offset, per_row) in section_offsets(enc, n).items()
    }
    return decode_sections(enc, sections, m)


def compress(enc: Encoding, raw: bytes) -> bytes:
    codec, level = parse_compression(enc.compression)
    if codec == "none":
        return raw
    import pyarrow as pa

    return pa.Codec("zstd", compression_level=level).compress(raw, asbytes=True)


def decompress(enc: Encoding, data: bytes, raw_size: int) -> bytes:
    codec, _ = parse_compression(enc.compression)
    if codec == "none":
        return data
    import pyarrow as pa

    return pa.Codec("zstd").decompress(data, decompressed_size=raw_size, asbytes=True)
