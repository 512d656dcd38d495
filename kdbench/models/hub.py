"""``hf:ORG/NAME`` model names: a Hugging Face model's ``config.json`` read from the local Hugging Face cache only,
never the network, and built with random weights like every other model.

The cache is the one ``huggingface_hub`` uses: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (read when a name is looked up, so a changed
environment applies).  The lookup is ``huggingface_hub.try_to_load_from_cache`` (the ``main`` revision of
``models--ORG--NAME``: ``refs/main`` names the snapshot whose ``config.json`` is read), which reads files and never
connects.  A config that is not there ends in one line that says how to put it there.

A cached config whose ``model_type`` is ``bert`` names a BERT-shaped encoder (:mod:`kdbench.models.encoders`), any
other a causal LM (:mod:`kdbench.models.lm`).  An ``hf:`` name contains a colon, as a ``module:callable`` does:
:func:`is_callable_name` is the one test that tells them apart.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from kdbench.core.errors import KdbenchError

HF_PREFIX = "hf:"
# a Hub repository id: NAME or ORG/NAME, each part letters, digits, '-', '_', '.' (huggingface_hub's
# validate_repo_id: at most 96 characters, no '--' or '..', no leading or trailing '-' or '.')
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def is_hf_name(name: Any) -> bool:
    """A ``hf:ORG/NAME`` model name (well formed or not: :func:`hf_config_path` says what is wrong)."""
    return isinstance(name, str) and name.startswith(HF_PREFIX)


def is_callable_name(name: Any) -> bool:
    """A user's ``module:callable`` model name (an ``hf:`` name is not one)."""
    return isinstance(name, str) and ":" in name and not is_hf_name(name)


def hub_cache() -> Path:
    """The local Hugging Face cache, as huggingface_hub finds it from the environment now."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return Path(os.environ[key]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def repo_id(name: str) -> str:
    """The repository id of ``hf:ORG/NAME``; KdbenchError, one line, for a malformed one."""
    repo = name[len(HF_PREFIX) :]
    if not repo:
        raise KdbenchError(f"{name!r} names no model: write hf:ORG/NAME, e.g. hf:Qwen/Qwen2.5-0.5B")
    bad = (
        len(repo) > 96
        or not _REPO_ID.match(repo)
        or "--" in repo
        or ".." in repo
        or any(part[:1] in "-." or part[-1:] in "-." for part in repo.split("/"))
    )
    if bad:
        raise KdbenchError(
            f"{name!r} is no Hugging Face model id: write hf:ORG/NAME (letters, digits, '-', '_', '.'; one '/'), "
            "e.g. hf:Qwen/Qwen2.5-0.5B"
        )
    return repo


def hf_config_path(name: str) -> Path:
    """The ``config.json`` of ``hf:ORG/NAME`` in the local Hugging Face cache; KdbenchError, one line saying how to
    put it there, when it is not there.  Never connects."""
    repo = repo_id(name)
    cache = hub_cache()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError as exc:
        from kdbench.core.install import extra_hint

        raise KdbenchError(
            f"{name}: reading the Hugging Face cache needs huggingface_hub ({exc}): {extra_hint('lm')}"
        ) from None
    found = try_to_load_from_cache(repo, "config.json", cache_dir=cache)
    if isinstance(found, str) and Path(found).is_file():
        return Path(found)
    folder = "models--" + repo.replace("/", "--")
    raise KdbenchError(
        f"{name}: config.json is not in the local Hugging Face cache ({cache}; HF_HOME or HF_HUB_CACHE set it) and "
        f"kdbench never downloads: on a machine with network run `hf download {repo} config.json` (or "
        f"`huggingface-cli download {repo} config.json`), then copy its {folder} folder into {cache}"
    )


def cached_config(name: str) -> dict[str, Any] | None:
    """The fields of ``hf:ORG/NAME``'s cached ``config.json`` (None: a malformed name, not cached, or not a JSON
    object): what tells an encoder (``model_type: bert``) from a causal LM before either is built."""
    try:
        data = json.loads(hf_config_path(name).read_text())
    except (KdbenchError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
