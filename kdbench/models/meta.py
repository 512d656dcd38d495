"""Language models and encoders built on the meta device for the plan's checks: no memory, no initialisation,
transformers' own validation run; what it refuses said at the override that caused it.

:func:`lm_facts` and :func:`encoder_facts` build a model on ``meta`` (a registered name with its overrides, a
``config.json``, or a ``module:callable`` when imports are allowed) and keep what the plan checks against it
(:class:`ModelFacts`), cached per model and overrides within the process.  A model that cannot be built raises
:class:`ModelConfigError` naming the override at fault: any exception transformers raises is caught, and the
override is found by building without each override in turn.  Shapes that transformers accepts but a forward
cannot take are found by a forward of one short batch on fake tensors (``FakeTensorMode``: shapes only); only
shape errors count, anything a fake forward cannot tell is left to the run.  User code (``module:callable``) is
found without an import, and imported and called here only with ``allow_imports``; when it cannot be called on
``meta`` the checks that need it are left to the run (:attr:`ModelFacts.known` False).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.models.config_checks import (
    ModelConfigError,
    check_shapes,
    check_values,
    number,
    unquote_fix,
)
from kdbench.models.hub import hf_config_path, is_callable_name, is_hf_name

PROBE_TOKENS = 8  # the fake forward's sequence length: shapes, not lengths (positions are checked apart)
# Errors of a forward whose shapes do not fit (a fake forward raises them as a real one would).
_SHAPE_ERRORS = (
    "must match the size of tensor",
    "shapes cannot be multiplied",
    "Attempting to broadcast",
    "is invalid for input of size",
    "size mismatch",
    "Sizes of tensors must match",
    "divisible",
)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the plan checks against a model built on ``meta`` (``known`` False: user code that could not be built
    there; then only ``hf`` and ``vocab`` may be set, the rest is left to the run)."""

    known: bool = True
    config: Any = None  # the transformers config (None: a module:callable that is no transformers model)
    modules: frozenset[str] = frozenset()  # module paths of the wrapped model (CausalLM / Encoder), as hooks see them
    layers: tuple[str, ...] = ()  # its decoder or encoder layers, in order
    hf: bool = False  # a transformers model with an LM head (the hidden states and the head apart)
    head: str | None = None  # why its LM head cannot be cut to a vocabulary (None: it can, or it has none)
    vocab: int | None = None  # entries of its vocabulary (the head's rows, or the logits' width)
    can_generate: bool = False  # samples token by token with a KV cache (on-policy distillation)
    returns: str | None = None  # what a model without an LM head returns when it is not logits (B, S, V)
    params: int | None = None  # parameters (tied ones once): the host's count of a copy (run.plan's host figure)
    largest: int | None = None  # elements of the largest parameter (the one drawn at a time in float32)


def sizes(model: nn.Module) -> dict[str, int]:
    """``params`` and ``largest`` of a model (``parameters()`` yields a tied parameter once)."""
    numels = [p.numel() for p in model.parameters()]
    return {"params": sum(numels), "largest": max(numels, default=0)}


# --------------------------------------------------------------------------- quiet building


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Build without a word on stderr: transformers' config warnings (a token id beyond a shrunk vocabulary),
    Python warnings and the fake tensors' log of the errors they re-raise."""
    from kdbench.models.lm import transformers_module

    tf_logging = transformers_module().utils.logging
    verbosity = tf_logging.get_verbosity()
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = fake_log.disabled
    tf_logging.set_verbosity_error()
    fake_log.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tf_logging.set_verbosity(verbosity)
        fake_log.disabled = disabled


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """The Hugging Face Hub offline (``HF_HUB_OFFLINE``, read at each request) while user code builds its model on
    meta: a ``from_pretrained`` inside it reads the local cache or fails, and the run builds it for real."""
    try:
        from huggingface_hub import constants
    except ImportError:
        yield
        return
    offline = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = offline


def one_line(exc: BaseException) -> str:
    """An exception as one line: transformers' validation errors by their cause (their last line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1].rstrip(".") if lines else ""
    if not re.match(r"^[A-Za-z_.]*(Error|Exception): ", text):
        text = f"{type(exc).__name__}: {text}"
    return text[:400]


def _fix(text: str, key: str, value: Any) -> str:
    """The fix for one of transformers' refusals, where its words tell it."""
    typed = re.search(r"expected (\w+), got (\w+)", text)
    if typed:
        want, got = typed.groups()
        if want == "float" and got == "int":
            return f"write {value}.0"
        if want in ("int", "float") and got == "str" and number(value) is not None:
            return unquote_fix(value, want)
        return f"give a{'n' if want[0] in 'aeiou' else ''} {want}"
    if text.startswith("KeyError: ") and isinstance(value, str) and repr(value) in text:
        hint = _activation_hint(value) if "act" in key else ""
        return f"{value!r} is not a name transformers knows here; {hint}change it"
    return "change it or remove it"


def _activation_hint(value: str) -> str:
    try:
        from transformers.activations import ACT2FN
    except ImportError:
        return ""
    return did_you_mean(value, sorted(ACT2FN), quote=True) or f"known: {', '.join(sorted(ACT2FN))}; "


def fake_forward(model: nn.Module, tokens: int = PROBE_TOKENS) -> tuple[Any, BaseException | None]:
    """``model`` (built on meta) called on one sequence of ``tokens`` ids on fake tensors: (its output, None), or
    (None, the shape error it raised); (None, None) when a fake forward cannot tell (no FakeTensorMode in this torch,
    a data-dependent branch, an operator without a meta kernel, any error that is not about shapes)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        return None, None
    try:
        with quiet(), torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            return model(torch.zeros(1, tokens, dtype=torch.long, device="meta")), None
    except Exception as exc:  # which errors are shape errors is read from their text
        text = str(exc)
        if "meta" not in text and any(s in text for s in _SHAPE_ERRORS):
            return None, exc
        return None, None


# --------------------------------------------------------------------------- building, the override found


def build_checked(
    build: Callable[[dict[str, Any]], nn.Module],
    overrides: dict[str, Any],
    what: str,
    forward: Callable[[nn.Module], tuple[Any, BaseException | None]] | None = None,
) -> nn.Module | None:
    """``build(overrides)`` (a model on meta), and ``forward(model)`` when given; their failure a
    :class:`ModelConfigError` at the override whose absence lets the model build and run (``what``: the model, as
    the message names it).  None: the model cannot be built on meta at all (the run will tell)."""

    def attempt(fields: dict[str, Any]) -> tuple[nn.Module | None, BaseException | None, str]:
        try:
            with quiet():
                model = build(copy.deepcopy(fields))  # transformers fills in nested dicts (rope_scaling) in place
        except Exception as exc:  # transformers raises ValueError, TypeError, KeyError, ...
            if isinstance(exc, KdbenchError) or not _meta_only(exc):
                return None, exc, "refuses"
            return None, None, ""  # an error of the meta device, not of the model
        if forward is not None:
            _, error = forward(model)
            if error is not None:
                return None, error, "cannot run a forward with"
        return model, None, ""

    model, error, stage = attempt(overrides)
    if error is None:
        return model
    if isinstance(error, ModelConfigError):
        raise error
    if isinstance(error, KdbenchError):
        raise ModelConfigError(str(error), _named_field(str(error), overrides))
    text = one_line(error)
    at_fault = [k for k in overrides if attempt({f: v for f, v in overrides.items() if f != k})[0] is not None]
    if not at_fault:
        raise ModelConfigError(f"{what} {stage} its config: {text}; {_fix(text, *_field_of(text))}", text=text)
    key = at_fault[0]
    others = f" (with {', '.join(at_fault[1:])})" if len(at_fault) > 1 else ""
    raise ModelConfigError(
        f"{what} {stage} {key} = {overrides[key]!r}{others}: {text}; {_fix(text, key, overrides[key])}", key
    )


def _meta_only(exc: BaseException) -> bool:
    """An error of the meta device itself (data read back, an operator without a meta kernel), not of the model."""
    return isinstance(exc, NotImplementedError) or "meta" in str(exc)


def _named_field(message: str, overrides: dict[str, Any]) -> str | None:
    named = [k for k in overrides if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", message)]
    return named[0] if named else None


def _field_of(text: str) -> tuple[str, Any]:
    """The field and value transformers names in a refusal (``Field 'x' expected int, got str (value: '4')``)."""
    field = re.search(r"[Ff]ield '(\w+)'", text)
    value = re.search(r"\(value: (.*)\)", text)
    raw: Any = value.group(1) if value else None
    if isinstance(raw, str) and len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "'\"":
        raw = raw[1:-1]
    return (field.group(1) if field else ""), raw


def config_file_error(path: str, exc: BaseException) -> ModelConfigError:
    """transformers' refusal of a config.json's own fields, naming the file and the field (the one transformers
    names, else the one without which the file's config builds)."""
    text = one_line(exc)
    field, value = _field_of(text)
    if not field:
        field = _file_field_at_fault(path) or ""
        value = _file_fields(path).get(field)
    return _file_error(path, field, value, text)


def _file_error(path: str, field: str, value: Any, text: str) -> ModelConfigError:
    where = f" field {field!r}" if field else ""
    fix = f"write {value} without quotes" if number(value) is not None else _fix(text, field, value)
    return ModelConfigError(f"model config {path}:{where} {text}; {fix} in the file")


def _file_fields(path: str) -> dict[str, Any]:
    try:
        return dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _file_field_at_fault(path: str, model: bool = False) -> str | None:
    """The field of config.json ``path`` whose absence (transformers' default instead) lets its config build (with
    ``model``, its model too, on meta)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kdbench.models.lm import build_lm

    data = _file_fields(path)
    if data.get("model_type") not in CONFIG_MAPPING:
        return None
    config_class = CONFIG_MAPPING[data["model_type"]]
    fields = {k: v for k, v in data.items() if k != "model_type"}
    for key in fields:
        try:
            with quiet():
                config = config_class.from_dict({k: v for k, v in copy.deepcopy(fields).items() if k != key})
                if model:
                    build_lm(config, device="meta")
        except Exception:  # still refused without it: not this one
            continue
        return key
    return None


# --------------------------------------------------------------------------- language models


def _stamp(name: str) -> tuple[int, int] | None:
    """A config.json's modification time and size (a changed file is built again; an ``hf:`` name's file in the
    cache too); None otherwise."""
    try:
        if is_hf_name(name):
            path = hf_config_path(name)
        elif is_callable_name(name) or not name.endswith(".json"):
            return None
        else:
            path = Path(name)
        st = path.stat()
    except (OSError, KdbenchError):  # said when the model is built
        return None
    return st.st_mtime_ns, st.st_size


def _key(overrides: dict[str, Any]) -> str:
    return json.dumps(overrides, sort_keys=True, default=repr)


def clear_cache() -> None:
    """Forget every model built on meta (a test that changes how models build)."""
    _lm_facts.cache_clear()
    _encoder_facts.cache_clear()


def lm_facts(name: str, overrides: dict[str, Any], allow_imports: bool) -> ModelFacts:
    """The facts of LM ``name`` with ``overrides``, built on meta once per process (a config.json again when it
    changed); raises :class:`ModelConfigError` (or KdbenchError for a name that is no model)."""
    facts, error = _lm_facts(name, _key(overrides), allow_imports, _stamp(name))
    if error is not None:
        raise error
    return facts  # type: ignore[return-value]


@functools.lru_cache(maxsize=256)
def _lm_facts(name: str, key: str, allow_imports: bool, _stamp: Any) -> tuple[ModelFacts | None, Exception | None]:
    try:
        return _build_lm_facts(name, json.loads(key), allow_imports), None
    except KdbenchError as exc:
        return None, exc


def _build_lm_facts(name: str, overrides: dict[str, Any], allow_imports: bool) -> ModelFacts:
    from kdbench.models.lm import CausalLM, build_lm, model_config

    if is_callable_name(name):
        return _callable_facts(name, allow_imports)
    try:
        with quiet():
            base = model_config(name, {})  # a config.json's own mistakes are its file's
    except KdbenchError:
        raise
    except Exception as exc:  # transformers validates the file's fields
        raise config_file_error(name, exc) from None
    what = f"{name}'s {type(base).__name__}"
    check_values(base, _defaults(type(base)), overrides, what, next_token=True)
    needs_forward = bool(overrides) or name.endswith(".json") or is_hf_name(name)

    def build(fields: dict[str, Any]) -> nn.Module:
        config = model_config(name, fields)
        check_shapes(config, fields, what, next_token=True)
        return build_lm(config, device="meta")

    def forward(model: nn.Module) -> tuple[Any, BaseException | None]:
        return fake_forward(CausalLM(model))

    try:
        model = build_checked(build, overrides, what, forward if needs_forward else None)
    except ModelConfigError as exc:  # a config.json whose model transformers refuses: which of its fields
        field = (
            _file_field_at_fault(name, model=True) if exc.text and name.endswith(".json") and not overrides else None
        )
        if field:
            raise _file_error(name, field, _file_fields(name)[field], exc.text) from None
        raise
    if model is None:
        with quiet():
            return ModelFacts(known=False, config=model_config(name, overrides))
    return _facts(CausalLM(model), getattr(model, "config", None))


@functools.lru_cache(maxsize=32)
def _defaults(config_class: type) -> dict[str, Any]:
    with quiet():
        return config_class().to_dict()


def _callable_facts(name: str, allow_imports: bool) -> ModelFacts:
    """A ``module:callable`` LM: found without importing it; with ``allow_imports``, imported and called on meta."""
    import importlib

    from kdbench.models.lm import CausalLM
    from kdbench.models.registry import check_model_name

    check_model_name(name, allow_imports)  # the module exists; imports are allowed
    module_name, _, attr = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module raised while it was imported
        why = f"importing {module_name!r} failed ({one_line(exc)}); fix that module"
        raise KdbenchError(f"model {name!r}: {why}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KdbenchError(f"model {name!r}: {module_name!r} has no attribute {attr!r}; fix the name after ':'")
        obj = getattr(obj, part)
    try:
        with quiet(), _hub_offline(), torch.device("meta"):  # never a download at plan time
            model = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    except Exception:  # user code that cannot run on meta: the run builds it for real
        return ModelFacts(known=False)
    if not isinstance(model, nn.Module):
        raise KdbenchError(f"model {name!r} returned {type(model).__name__}, not a torch.nn.Module; return the model")
    wrapped = CausalLM(model)
    facts = _facts(wrapped, getattr(model, "config", None))
    if facts.hf:
        return facts
    out, _ = fake_forward(wrapped)  # a module that returns logits: their width is its vocabulary
    if isinstance(out, torch.Tensor) and out.dim() == 3:
        return dataclasses.replace(facts, vocab=int(out.shape[-1]))
    returns = None if out is None else f"{type(out).__name__}{list(out.shape) if hasattr(out, 'shape') else ''}"
    return dataclasses.replace(facts, returns=returns)


def _facts(wrapped: nn.Module, config: Any) -> ModelFacts:
    """The facts of a wrapped model (a :class:`~kdbench.models.lm.CausalLM`)."""
    head = wrapped.head
    head_problem = None
    if head is not None:
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            head_problem = f"its LM head is a {type(head).__name__} without a 2-D weight to cut to a vocabulary"
    vocab = wrapped.vocab_size if head_problem is None else getattr(config, "vocab_size", None)
    generates = getattr(wrapped.lm, "can_generate", None)
    return ModelFacts(
        config=config,
        modules=frozenset(n for n, _ in wrapped.named_modules() if n),
        layers=tuple(wrapped.decoder_layers()),
        hf=wrapped.hf,
        head=head_problem,
        vocab=int(vocab) if isinstance(vocab, int) else None,
        can_generate=wrapped.hf and (generates() if callable(generates) else True),
        **sizes(wrapped),
    )


# --------------------------------------------------------------------------- encoders


def encoder_facts(name: str, overrides: dict[str, Any]) -> ModelFacts:
    """The facts of encoder ``name`` with ``overrides``, built on meta once per process; raises
    :class:`ModelConfigError` (or KdbenchError for a name that is no encoder)."""
    facts, error = _encoder_facts(name, _key(overrides))
    if error is not None:
        raise error
    return facts  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _encoder_facts(name: str, key: str) -> tuple[ModelFacts | None, Exception | None]:
    from kdbench.models.encoders import ATTN_KEY, Encoder, build_encoder, encoder_config

    overrides = json.loads(key)
    try:
        with quiet():
            base = encoder_config(name, {})
        what = f"{name}'s {type(base).__name__}"
        check_values(
            base, _defaults(type(base)), {k: v for k, v in overrides.items() if k != ATTN_KEY}, what, next_token=False
        )

        def build(fields: dict[str, Any]) -> nn.Module:
            check_shapes(encoder_config(name, fields), fields, what, next_token=False)
            return build_encoder(name, fields, device="meta")

        def forward(model: nn.Module) -> tuple[Any, BaseException | None]:
            return fake_forward(Encoder(model))

        model = build_checked(build, overrides, what, forward if overrides else None)
    except KdbenchError as exc:
        return None, exc
    if model is None:
        with quiet():
            return ModelFacts(known=False, config=encoder_config(name, overrides)), None
    wrapped = Encoder(model)
    modules = frozenset(n for n, _ in wrapped.named_modules() if n)
    return ModelFacts(config=model.config, modules=modules, layers=tuple(wrapped.layers()), **sizes(wrapped)), None
