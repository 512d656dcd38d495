"""Model registry: names to builders, and :func:`build_model`.

A model name is one of

* a registered name (``cifar`` and ``seed`` families, see :func:`register_model`),
* a torchvision classification model (``torchvision`` family, listed lazily),
* ``"module:callable"``: user code, imported only when ``allow_imports`` is set.

Every builder is called as ``builder(num_classes=..., in_shape=...)`` where
``in_shape`` is one sample's shape without the batch dimension.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.core.registry import Registry

Builder = Callable[..., nn.Module]

FAMILIES = ("cifar", "torchvision", "toy")


def _unknown_model(name: str) -> str:
    close = did_you_mean(name, available_models())
    hint = f"{close}(`kdbench list models` shows all)" if close else "pick one from `kdbench list models`"
    return f"unknown model {name!r}; {hint}"


_REGISTRY: Registry[tuple[str, Builder]] = Registry("model", unknown=_unknown_model)  # name -> (family, builder)

MIN_IMAGE_SIZE = 8  # CIFAR models: three stride-2 stages need at least 8x8

# torchvision classifiers whose layers cannot take smaller images (checked by a forward pass here).
_TORCHVISION_MIN_SIDE = {"alexnet": 63, "inception_v3": 75}
_MAXVIT_SIDE = 224  # maxvit partitions every stage into 7x7 windows: sides must be multiples of 224

_TORCHVISION_EXTRA_KWARGS = {
    # Without these, train-mode forward returns a namedtuple with aux logits.
    "googlenet": {"aux_logits": False, "init_weights": False},
    "inception_v3": {"aux_logits": False, "init_weights": False},
}


def register_model(name: str, family: str) -> Callable[[Builder], Builder]:
    """Decorator registering ``fn(num_classes, in_shape) -> nn.Module`` as ``name``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")

    def decorate(fn: Builder) -> Builder:
        _REGISTRY.register(name, (family, fn))
        return fn

    return decorate


@functools.cache
def _torchvision_names() -> frozenset[str]:
    """Names of torchvision's classification models (imports torchvision once)."""
    import torchvision

    return frozenset(torchvision.models.list_models(module=torchvision.models))


def available_models() -> dict[str, str]:
    """Map every known model name to its family, sorted by name."""
    models = {name: "torchvision" for name in _torchvision_names()}
    models.update({name: family for name, (family, _) in _REGISTRY.items()})
    return dict(sorted(models.items()))


def check_model_name(name: str, allow_imports: bool = False) -> None:
    """Raise :class:`KdbenchError` unless ``name`` can be built; imports no user code."""
    if ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr:
            raise KdbenchError(f"model {name!r} must look like 'package.module:callable'")
        missing = missing_module(module)
        absent = (
            f"no module named {missing!r} (looked for on sys.path, not imported): check the module name and that its "
            "folder is on PYTHONPATH"
            if missing
            else ""
        )
        if not allow_imports:
            also = f"; and {absent}" if absent else ""
            why = "imports user code; set `allow_imports: true` in the suite or pass --allow-imports"
            raise KdbenchError(f"model {name!r} {why}{also}")
        if absent:
            raise KdbenchError(f"model {name!r}: {absent}")
        return
    if name in _REGISTRY or name in _torchvision_names():
        return
    raise KdbenchError(_REGISTRY.unknown(name))


def missing_module(module: str) -> str | None:
    """The first part of dotted ``module`` that no import finder finds (None: every part is found), asked of the
    finders directly, so that no package's ``__init__`` runs: user code is only looked for, never imported."""
    import sys

    path = None
    parts = module.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        loaded = sys.modules.get(full)
        if loaded is not None:
            path = getattr(loaded, "__path__", None)
        else:
            spec = next((s for f in sys.meta_path if (s := _find(f, full, path)) is not None), None)
            if spec is None:
                return full
            path = spec.submodule_search_locations
            if path is not None and spec.origin is None:
                # a namespace package (a folder without __init__.py): importing it runs no code, and its
                # submodules can only be looked for through it (their search path reads the parent's from
                # sys.modules: KeyError otherwise)
                path = importlib.import_module(full).__path__
        if path is None and i < len(parts) - 1:
            return ".".join(parts[: i + 2])  # a module, not a package: it has no submodules
    return None


def _find(finder, name: str, path):
    find = getattr(finder, "find_spec", None)
    try:
        return find(name, path) if find is not None else None
    except (ImportError, ValueError):
        return None


def build_model(
    name: str,
    num_classes: int,
    in_shape: tuple[int, ...],
    allow_imports: bool = False,
) -> nn.Module:
    """Build model ``name`` with fresh weights (seed ``torch`` beforehand for determinism)."""
    check_model_name(name, allow_imports)
    check_model_input(name, in_shape)
    if num_classes < 1:
        raise KdbenchError(f"num_classes must be at least 1 for model {name!r} (got {num_classes})")
    in_shape = tuple(in_shape)
    if ":" in name:
        return _build_imported(name, num_classes, in_shape)
    if name in _REGISTRY:
        return _REGISTRY[name][1](num_classes=num_classes, in_shape=in_shape)
    return _build_torchvision(name, num_classes, in_shape)


def check_model_input(name: str, in_shape: tuple[int, ...] | list[int]) -> None:
    """The input shapes a model family accepts, checked without building anything."""
    family = available_models().get(name)
    shape = list(in_shape)
    if family == "torchvision":
        if len(shape) != 3 or shape[0] != 3:
            raise KdbenchError(f"model {name!r} needs 3-channel images; set data.shape to [3, H, W] (got {shape})")
        side = _TORCHVISION_MIN_SIDE.get(name, 1)
        if min(shape[1:]) < side:
            raise KdbenchError(
                f"model {name!r} needs images of at least {side}x{side}; enlarge data.shape (got {shape})"
            )
        if name.startswith("maxvit_") and (shape[1] % _MAXVIT_SIDE or shape[2] % _MAXVIT_SIDE):
            raise KdbenchError(
                f"model {name!r} needs image sides that are multiples of {_MAXVIT_SIDE}; set data.shape to "
                f"[3, 224, 224] (got {shape})"
            )
        if name.startswith("vit_"):
            patch = int(name.rsplit("_", 1)[-1])
            if shape[1] != shape[2] or shape[1] % patch:
                raise KdbenchError(
                    f"model {name!r} needs square images whose side is a multiple of its patch size {patch}; "
                    f"set data.shape to e.g. [3, 224, 224] (got {shape})"
                )
    elif family == "cifar" and (len(shape) != 3 or min(shape[1:]) < MIN_IMAGE_SIZE):
        raise KdbenchError(
            f"model {name!r} needs images of at least {MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE}; "
            f"set data.shape to [C, H, W] with H, W >= {MIN_IMAGE_SIZE} (got {shape})"
        )


def count_params(model: nn.Module) -> int:
    """Number of parameters (trainable or not) of ``model``."""
    return sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """``torch.nn.init``'s in-place initialisers made no-ops inside (counting parameters needs their shapes)."""
    saved = {n: f for n, f in vars(torch.nn.init).items() if n.endswith("_") and not n.startswith("_")}
    try:
        for n in saved:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def parameter_count(name: str, num_classes: int, in_shape: tuple[int, ...]) -> int:
    """Parameters of registered model ``name``, built on the meta device (no memory, no initialisation); a
    builder that computes with tensors while it builds (torchvision's RegNets) is built on the CPU without
    initialising."""
    try:
        with torch.device("meta"):
            return count_params(build_model(name, num_classes, in_shape))
    except (NotImplementedError, RuntimeError):
        with _no_init():
            return count_params(build_model(name, num_classes, in_shape))


def _build_torchvision(name: str, num_classes: int, in_shape: tuple[int, ...]) -> nn.Module:
    """Build a torchvision classifier without pretrained weights."""
    import torchvision

    extra = dict(_TORCHVISION_EXTRA_KWARGS.get(name, {}))
    if name.startswith("vit_"):
        extra["image_size"] = in_shape[1]  # position embeddings sized for the data, not only 224
    if name.startswith("maxvit_"):
        extra["input_size"] = tuple(in_shape[1:])
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)


def _build_imported(name: str, num_classes: int, in_shape: tuple[int, ...]) -> nn.Module:
    """Import ``module:callable`` and call it with the arguments it accepts."""
    module_name, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        reason = " ".join(str(err).split())
        raise KdbenchError(
            f"model {name!r}: cannot import {module_name!r} ({reason}); "
            "check the module name and that its folder is on PYTHONPATH"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KdbenchError(f"model {name!r}: {module_name!r} has no attribute {attr!r}; fix the name after ':'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise KdbenchError(f"model {name!r}: {attr!r} is not callable; point to a function or class")
    offered = {"num_classes": num_classes, "in_shape": in_shape}
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    model = obj(**{k: v for k, v in offered.items() if takes_any or k in params})
    if not isinstance(model, nn.Module):
        raise KdbenchError(
            f"model {name!r} returned {type(model).__name__}, not a torch.nn.Module; make the callable return the model"
        )
    return model


@register_model("linear", "toy")
def linear(num_classes: int, in_shape: tuple[int, ...]) -> nn.Module:
    """A single linear layer on the flattened input (e.g. 784 -> 10 for MNIST)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), num_classes))
