"""Each small model built once per worker, handed out as fresh copies of its initial weights; a large one is never
kept (its float32 master would hold host memory for as long as the worker lives)."""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

from kdbench.models.registry import build_model

# The largest model the cache keeps, in float32 bytes: gpt2 (124 M parameters, 498 MB) is kept, Qwen2.5-0.5B (494 M,
# 1.98 GB) and every larger language model are not.  Keeping saves a rebuild per cell (the tiny Llama teacher: 70 ms
# against an 11 ms copy; gpt2: 2.5 s against 0.4 s); a large model is built afresh, directly where and in the dtype
# its cell uses it (:mod:`kdbench.workloads`).
MAX_KEPT_BYTES = 512 * 2**20


def param_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters as they are held (tied ones once)."""
    return sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())


class ModelCache:
    """Builds each model once per worker and hands out fresh copies of its initial weights.

    Building (random init of every layer) costs far more than copying, and a copy per
    cell keeps cells independent: no optimizer state, trained weights or batch-norm
    statistics leak from one cell into the next.  The key is (name, classes, input
    shape, seed): the same seed always gives the same initial weights.  Language models and
    encoders above ``max_kept_bytes`` are not kept (:meth:`get_built`, :meth:`keeps`).  A cache of
    ``capacity`` 0 keeps nothing and copies nothing: every model is built afresh and handed over itself.
    """

    def __init__(self, allow_imports: bool = False, capacity: int = 6, max_kept_bytes: int | None = None):
        self.allow_imports = allow_imports
        self.capacity = capacity
        self._max_kept = max_kept_bytes  # None: MAX_KEPT_BYTES, the figure the plan counts with
        self._models: OrderedDict[tuple, nn.Module] = OrderedDict()
        self.builds = 0

    def get(self, name: str, num_classes: int, shape: tuple[int, ...], seed: int) -> nn.Module:
        """A fresh copy of the registry's model ``name`` (:meth:`get_built`: built once per name, classes, input
        shape and seed; over :data:`MAX_KEPT_BYTES` not kept, as for any model)."""
        key = (name, num_classes, tuple(shape), seed)
        return self.get_built(
            key, seed, lambda: build_model(name, num_classes, tuple(shape), allow_imports=self.allow_imports)
        )

    def kept_tensors(self) -> list[torch.Tensor]:
        """The parameters and buffers of the models kept (the masters copies are made from): host memory the
        worker holds besides any cell's step, left out of a step's live peak
        (:func:`kdbench.measure.memory.step_live_peak`)."""
        return [t for m in self._models.values() for t in (*m.parameters(), *m.buffers())]

    @property
    def max_kept_bytes(self) -> int:
        return MAX_KEPT_BYTES if self._max_kept is None else self._max_kept

    def keeps(self, nbytes: int | None) -> bool:
        """Whether a model of ``nbytes`` float32 bytes is kept (:data:`MAX_KEPT_BYTES`; None: not known before it
        is built)."""
        return self.capacity > 0 and nbytes is not None and nbytes <= self.max_kept_bytes

    def get_built(self, key: tuple, seed: int, build) -> nn.Module:
        """A fresh copy of what ``build()`` returns, built once per ``key`` with torch seeded by ``seed`` (the
        language models, whose builder takes other arguments).  A model over :data:`MAX_KEPT_BYTES` is not kept:
        it is returned itself, and built again next time (no float32 master stays on the host)."""
        if key not in self._models:
            torch.manual_seed(seed)
            model = build()
            self.builds += 1
            if self.capacity == 0 or param_bytes(model) > self.max_kept_bytes:
                return model
            self._models[key] = model
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
        self._models.move_to_end(key)
        return copy.deepcopy(self._models[key])
