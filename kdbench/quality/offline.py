"""The text quality protocol's offline-teacher students (``teacher.mode: offline``): bits per byte show what an
encoding costs in learning, not only in KL.

The seed's trained teacher runs once over the training windows (each window and its next byte: the store's
sequences), writing its top-k in the cell's encoding to a store in a temporary folder
(:func:`kdbench.workloads.lm.offline.build_store`); each training step then reads its batch's windows' rows from the
store (by window index, positioned reads), decoded, and the student trains on the sparse KL over them
(:func:`kdbench.distill.lm.topk.topk_forward_kl`), as the timed offline step does.  The store is deleted once the
student is trained; its build is not in the training's time.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdbench.config.schema import CellConfig
from kdbench.distill.lm.topk import TopKTeacher
from kdbench.distill.step import TeacherOutputs
from kdbench.workloads.lm.offline import build_store, open_store, sequences_per_shard, to_topk


class OfflineBatches:
    """A trained teacher's top-k over the training windows, on disk; :meth:`batch` reads a batch's rows."""

    def __init__(self, distiller: Any, cell: CellConfig, x_train: torch.Tensor, y_train: torch.Tensor):
        self.folder = Path(tempfile.mkdtemp(prefix="kdbench-quality-store-"))
        try:
            self.store = open_store(distiller, cell, None, path=self.folder / "store")
            seqs = torch.cat([x_train, y_train[:, -1:]], dim=1).cpu()
            build_store(distiller, self.store, seqs, cell.batch_size)
        except BaseException:
            self.close()
            raise
        self.per_shard = sequences_per_shard(x_train.shape[1])
        self.device, self.seq_len = x_train.device, x_train.shape[1]
        loss = distiller.loss_fn
        self.vocab, self.temperature = loss.vocab, loss.token.temperature

    def batch(self, indices: torch.Tensor) -> TeacherOutputs:
        """The stored top-k of the windows ``indices`` (B,), as the step's cached teacher outputs (B, S, k)."""
        rows = [self.store.read(int(i) // self.per_shard, int(i) % self.per_shard, 1) for i in indices.tolist()]
        _, logp, ids, rest = (np.concatenate(p) for p in zip(*rows))
        shape = (len(rows), self.seq_len)
        cache: TopKTeacher = to_topk(
            logp, ids, rest, self.store.encoding, self.vocab, self.temperature, self.device, shape
        )
        return TeacherOutputs(cache, [])

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
