"""How grouped-query attention reaches SDPA in transformers' ``sdpa`` integration: observed on an eager call, and
for a compiled one (which cannot be watched eagerly) from transformers' rule, mirrored here and checked against
what the eager call did (GPU review 4, M2).

A GQA model (``num_key_value_groups`` = heads / kv_heads > 1) has fewer K and V heads than query heads, and
transformers 5's ``sdpa_attention_forward`` (``transformers/integrations/sdpa_attention.py``) takes one of three
paths to SDPA, per attention call:

* ``enable_gqa``: SDPA's own GQA (``enable_gqa=True``) where ``use_gqa_in_sdpa`` allows it: no mask and K and V
  head sizes equal and <= 256 (CUDA, ROCm, the CPU), always with ``TRANSFORMERS_SDPA_FORCE_GQA=1``, and on a
  machine where XPU (torch >= 2.8) or MPS (torch >= 2.13) is available whatever the mask (transformers decides by
  what is available, not by the tensors' device);
* ``packed``: else, for one query token outside torch.compile, ``pack_gqa`` folds the query's groups into its
  sequence axis, so attention runs on the kv heads as they are cached;
* ``repeated``: else ``repeat_kv`` writes K and V × groups (every cached position, every layer) and SDPA reads the
  copies.  A static cache keeps a causal mask at one query token, so a compiled static decode step takes this
  path (dynamo skips the ``packed`` branch) where its eager pass packs;

``mha`` where groups = 1 (nothing to do).  :func:`observing` watches an eager call by wrapping the three functions
of that module for its duration (so nothing compiled ever traces the wrappers); :func:`sdpa_gqa_path` and
:func:`gqa_in_sdpa` are the rule (transformers 5.25), pure.  A transformers without that module, or without
``pack_gqa`` (4.x), gives None for what it cannot tell, never an error.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

ENABLE_GQA, PACKED, REPEATED, MHA = "enable_gqa", "packed", "repeated", "mha"
_WATCHED = ("use_gqa_in_sdpa", "pack_gqa", "repeat_kv")


def gqa_in_sdpa(
    masked: bool,
    head_dims: tuple[int, int],
    device_type: str = "cuda",
    torch_version: tuple[int, int] = (2, 14),
    force: bool = False,
) -> bool:
    """transformers' ``use_gqa_in_sdpa``: whether SDPA's own GQA is used (``force``: ``TRANSFORMERS_SDPA_FORCE_GQA``
    is 1; ``device_type`` "xpu" or "mps": that device is available; CUDA and the CPU: no mask and K and V head
    sizes ``head_dims`` equal and <= 256, as CUDA's fused kernels need)."""
    if force:
        return True
    if device_type == "xpu":
        return torch_version >= (2, 8)
    if device_type == "mps":
        return torch_version >= (2, 13)
    return not masked and head_dims[0] == head_dims[1] <= 256


def sdpa_gqa_path(groups: int, q_len: int, gqa: bool, compiling: bool) -> str:
    """The path of one attention call with ``groups`` query heads per kv head, ``q_len`` query tokens and
    :func:`gqa_in_sdpa`'s answer ``gqa``, eager or (``compiling``) under torch.compile (the module's docstring)."""
    if groups <= 1:
        return MHA
    if gqa:
        return ENABLE_GQA
    if q_len == 1 and not compiling:
        return PACKED
    return REPEATED


def force_gqa() -> bool:
    """Whether ``TRANSFORMERS_SDPA_FORCE_GQA`` forces SDPA's GQA (read as transformers reads it)."""
    return os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1"


def torch_release() -> tuple[int, int]:
    """The running torch's (major, minor)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def path_label(counts: Counter) -> str | None:
    """``repeated``; ``enable_gqa+packed`` where one model's calls took several (most calls first); None: none."""
    kinds = [k for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n > 0]
    return "+".join(kinds) or None


@dataclass
class Call:
    """One attention call seen: its model's name, its path, what ``use_gqa_in_sdpa`` was asked (the mask's
    presence, K's and V's head sizes; None where it was not asked) and the bytes ``repeat_kv`` wrote."""

    model: str
    path: str | None
    masked: bool | None = None
    head_dims: tuple[int, int] | None = None
    repeat_bytes: int = 0


@dataclass
class Seen:
    """What :func:`observing` saw: the calls in order."""

    compile_branch: bool = False  # the module has pack_gqa (transformers 5's rule, with its compiling branch)
    calls: list[Call] = field(default_factory=list)
    model: str = ""  # the model running now (set by forward pre-hooks when several are watched)

    def asked(self, mask: Any, key: torch.Tensor, value: torch.Tensor, answer: bool) -> None:
        dims = (int(key.shape[-1]), int(value.shape[-1]))
        self.calls.append(Call(self.model, ENABLE_GQA if answer else None, mask is not None, dims))

    def took(self, path: str, written: int = 0) -> None:
        """``pack_gqa`` (called for the query, the mask and the bias) or ``repeat_kv`` (for K, then V) ran: the
        same call as the last one unless that one took another path (or transformers did not ask first)."""
        last = self.calls[-1] if self.calls else None
        if last is None or last.model != self.model or last.path not in (None, path):
            last = Call(self.model, path)
            self.calls.append(last)
        last.path = path
        last.repeat_bytes += written

    def paths(self, groups: int | None, model: str = "") -> Counter | None:
        """How many of ``model``'s calls took each path, eagerly: ``mha`` with one group (``groups`` None: not
        known); None where no call was seen (no transformers SDPA attention: eager attention, another integration,
        another transformers)."""
        if groups is not None and groups <= 1:
            return Counter({MHA: 1})
        counts = Counter(c.path for c in self.calls if c.model == model and c.path is not None)
        return counts or None

    def compiled_paths(self, groups: int | None, q_len: int, device_type: str, model: str = "") -> Counter | None:
        """The same calls' paths under torch.compile, by :func:`sdpa_gqa_path` on what each call asked, provided the
        rule gives every eager path seen (else None: transformers' rule is not the one mirrored here, or it was
        not asked, as on transformers 4.x)."""
        if groups is not None and groups <= 1:
            return Counter({MHA: 1})
        calls = [c for c in self.calls if c.model == model]
        if not (self.compile_branch and calls) or any(c.masked is None for c in calls):
            return None
        groups = groups or 2  # calls are seen only where there are several groups
        version, force = torch_release(), force_gqa()
        compiled: Counter = Counter()
        for c in calls:
            gqa = gqa_in_sdpa(bool(c.masked), c.head_dims or (0, 0), device_type, version, force)
            if sdpa_gqa_path(groups, q_len, gqa, compiling=False) != c.path:
                return None
            compiled[sdpa_gqa_path(groups, q_len, gqa, compiling=True)] += 1
        return compiled

    def repeat_bytes(self, model: str = "") -> int:
        """The bytes ``repeat_kv`` wrote for ``model``'s calls (K and V × groups at every position they attend)."""
        return sum(c.repeat_bytes for c in self.calls if c.model == model)


@contextlib.contextmanager
def observing(models: dict[str, Any] | None = None) -> Iterator[Seen]:
    """Watch the eager calls inside: transformers' ``use_gqa_in_sdpa``, ``pack_gqa`` and ``repeat_kv`` wrapped for
    the duration (put back after, so a compiled function's guards on them still hold); ``models``: name -> module,
    each call put down to the one whose forward runs (a forward pre-hook each)."""
    seen = Seen()
    try:
        from transformers.integrations import sdpa_attention as sdpa
    except ImportError:  # no transformers, or one without the sdpa integration module (< 4.48)
        yield seen
        return
    originals = {name: getattr(sdpa, name) for name in _WATCHED if hasattr(sdpa, name)}
    seen.compile_branch = "pack_gqa" in originals

    def asks(mask, key, value, *args, **kwargs):
        answer = originals["use_gqa_in_sdpa"](mask, key, value, *args, **kwargs)
        seen.asked(mask, key, value, bool(answer))
        return answer

    def packs(hidden, n_rep, *args, **kwargs):
        seen.took(PACKED)
        return originals["pack_gqa"](hidden, n_rep, *args, **kwargs)

    def repeats(hidden, n_rep, *args, **kwargs):
        out = originals["repeat_kv"](hidden, n_rep, *args, **kwargs)
        seen.took(REPEATED, out.numel() * out.element_size() if n_rep > 1 else 0)
        return out

    wrappers = {"use_gqa_in_sdpa": asks, "pack_gqa": packs, "repeat_kv": repeats}
    hooks = []
    for name, module in (models or {}).items():
        hooks.append(module.register_forward_pre_hook(lambda *_, name=name: setattr(seen, "model", name)))
    try:
        for name in originals:
            setattr(sdpa, name, wrappers[name])
        yield seen
    finally:
        for name, original in originals.items():
            setattr(sdpa, name, original)
        for hook in hooks:
            hook.remove()
