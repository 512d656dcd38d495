"""Each model built once per worker, handed out as fresh copies of its initial weights."""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

from kdbench.models.registry import build_model


class ModelCache:
    """Builds each model once per worker and hands out fresh copies of its initial weights.

    Building (random init of every layer) costs far more than copying, and a copy per
    cell keeps cells independent: no optimizer state, trained weights or batch-norm
    statistics leak from one cell into the next.  The key is (name, classes, input
    shape, seed): the same seed always gives the same initial weights.
    """

    def __init__(self, allow_imports: bool = False, capacity: int = 6):
        self.allow_imports = allow_imports
        self.capacity = capacity
        self._models: OrderedDict[tuple, nn.Module] = OrderedDict()
        self.builds = 0

    def get(self, name: str, num_classes: int, shape: tuple[int, ...], seed: int) -> nn.Module:
        key = (name, num_classes, tuple(shape), seed)
        if key not in self._models:
            torch.manual_seed(seed)
            self._models[key] = build_model(name, num_classes, tuple(shape), allow_imports=self.allow_imports)
            self.builds += 1
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
        self._models.move_to_end(key)
        return copy.deepcopy(self._models[key])

    def get_built(self, key: tuple, seed: int, build) -> nn.Module:
        """A fresh copy of what ``build()`` returns, built once per ``key`` with torch seeded by ``seed`` (the
        language models, whose builder takes other arguments)."""
        if key not in self._models:
            torch.manual_seed(seed)
            self._models[key] = build()
            self.builds += 1
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
        self._models.move_to_end(key)
        return copy.deepcopy(self._models[key])
