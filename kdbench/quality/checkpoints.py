"""Trained quality models kept as they finish, so a stopped quality job loses at most the model in training.

Each model the protocol trains (a seed's teacher, scratch student, distilled student) is stored when its training
ends, in the run folder::

    <run folder>/_quality/<quality job id>/seed<S>-<role>-<which>.pt     ("_": the run's parquet readers skip it)

one ``torch.save`` file per model, written atomically (a hidden temporary, then ``os.replace``:
:func:`kdbench.store.files.write_atomic`), holding

* ``identity``: what the model was trained with, compared whole before any reuse: the quality block, the
  quality cell (models, overrides, precision, seed, recipe), the role, a SHA-256 of the data's tensors, the CPU
  thread count, the backend, the torch version, and for a distilled student its teacher's identity;
* the test record (:class:`kdbench.quality.train.Trained`: time and accuracy after each epoch, the test losses,
  the last test predictions) from which the model's row is made;
* ``state_dict``: the model's weights (on the CPU), and when it was saved.

The quality job's id hashes the quality block and the jobs' cells, so a rerun of the same suite into the same run
folder (``kdbench run --resume``, or the same ``--run-id``) finds the files again: a model whose file is there with
the same identity is not trained again (its row is made from the stored record and says so); one whose file holds
another identity (another thread count, other data, another torch) is trained again, the row saying why.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kdbench.store.files import write_atomic

CHECKPOINTS_DIR = "_quality"  # under a run folder


def digest(value: Any) -> str:
    """A short SHA-256 of ``value`` as sorted JSON (reprs for what JSON cannot say)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def tensors_digest(*tensors: torch.Tensor) -> str:
    """A SHA-256 of the tensors' shapes, dtypes and bytes (the data a model was trained and tested on)."""
    h = hashlib.sha256()
    for t in tensors:
        c = t.detach().cpu().contiguous()
        h.update(f"{tuple(c.shape)} {c.dtype};".encode())
        h.update(c.view(torch.uint8).numpy().data if c.numel() else b"")
    return h.hexdigest()


def differences(stored: dict[str, Any], wanted: dict[str, Any]) -> str:
    """What differs between two identities, in words (``threads 2, now 1``; ``data: other bytes``)."""
    out = []
    for key in sorted(set(stored) | set(wanted)):
        a, b = stored.get(key), wanted.get(key)
        if a == b:
            continue
        if isinstance(a, (dict, list)) or isinstance(b, (dict, list)) or len(repr(a)) + len(repr(b)) > 80:
            out.append(f"{key}: other settings")
        else:
            out.append(f"{key} {a}, now {b}")
    return "; ".join(out)


@dataclass(frozen=True)
class Stored:
    """A model read back from its file."""

    path: Path
    identity: dict[str, Any]
    record: dict[str, Any]  # history, test_losses, preds
    state_dict: dict[str, torch.Tensor]
    saved: str


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoint folder of one quality job."""

    folder: Path

    def path(self, seed: int, role: str, which: Any) -> Path:
        return self.folder / f"seed{seed}-{role}-{digest(which)[:12]}.pt"

    def load(self, path: Path, identity: dict[str, Any]) -> tuple[Stored | None, str | None]:
        """(the stored model, None) when ``path`` holds one trained with ``identity``; else (None, why not), the why
        None when there is no file."""
        if not path.is_file():
            return None, None
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            stored = Stored(path, data["identity"], data["record"], data["state_dict"], data["saved"])
        except Exception as exc:  # unreadable: another format, a damaged disk
            return None, f"its checkpoint {path.name} is unreadable ({type(exc).__name__})"
        if stored.identity != identity:
            return None, (
                f"its checkpoint {path.name} (saved {stored.saved}) was trained with other settings "
                f"({differences(stored.identity, identity)})"
            )
        return stored, None

    def save(self, path: Path, identity: dict[str, Any], record: dict[str, Any], model: torch.nn.Module) -> Path:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        saved = datetime.now(UTC).isoformat(timespec="seconds")
        data = {"identity": identity, "record": record, "state_dict": state, "saved": saved}
        return write_atomic(path, lambda tmp: torch.save(data, tmp))
