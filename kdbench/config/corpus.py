"""``teacher.corpus``: the token file an offline teacher's store is built over (:mod:`kdbench.data.token_file`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from kdbench.config.base import Strict


class CorpusConfig(Strict):
    # the token file: a NumPy .npy of integer ids (1-D, or 2-D read row after row), or a raw binary of
    # little-endian ids (nanoGPT's train.bin); relative: to the suite file's folder. Memory-mapped, never read whole
    path: str = Field(min_length=1)
    # a raw binary's id type: uint16 or uint32 (needed for anything but a .npy, which says its own)
    dtype: Literal["uint16", "uint32"] | None = None


def _shorthand(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value  # `corpus: PATH`: its path alone


# `corpus: PATH` or `corpus: {path: PATH, dtype: uint16}`; null: none
Corpus = Annotated[CorpusConfig | None, BeforeValidator(_shorthand)]
