"""The catalogue blocks: the methods (docs/methods.md), the models (docs/models.md) and the result columns
(docs/results.md), each from its registry."""

from __future__ import annotations

import sys
from typing import Any

from kdbench.docgen.markdown import NONE, code, first_paragraph, rst_to_md, table, yaml_value


def registered_methods() -> dict[str, Any]:
    from kdbench.distill.losses import METHODS

    return METHODS


def _what(doc: str) -> str:
    """A method's registered doc, ``citation: formula``, with the formula as code (it holds ``*`` and ``|``)."""
    doc = first_paragraph(doc)
    citation, sep, formula = doc.partition(": ")
    return f"{citation}: {code(formula)}" if sep else doc


def methods_table() -> str:
    """Every registered method: what it computes, its paper, its parameters' defaults, whether it needs features."""
    rows = []
    for m in registered_methods().values():
        params = ", ".join(f"{k}={yaml_value(v)}" for k, v in m.params().model_dump().items())
        paper = rst_to_md(first_paragraph(sys.modules[m.cls.__module__].__doc__))
        rows.append((code(m.name), _what(m.doc), paper, code(params) if params else NONE, _yes(m.cls.needs_features)))
    return "\n".join(table(["method", "what it is", "source", "parameters (defaults)", "needs features"], rows))


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# torchvision's models differ by release (the pins allow 0.20-0.29): the page lists the ones the shipped suites and
# the field's tables use, all in every release the pins allow, and says where the rest are
TORCHVISION_SHOWN = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "shufflenet_v2_x1_0",
    "efficientnet_b0",
    "convnext_tiny",
    "vit_b_16",
    "swin_t",
)


def _data_defaults() -> tuple[int, tuple[int, ...]]:
    from kdbench.config.schema import DataConfig

    data = DataConfig()
    return data.num_classes, tuple(data.shape)


def models_table() -> str:
    """Every family and model of the catalogue (:mod:`kdbench.models.catalogue`, as ``kdbench list models``
    lists it), with its parameter count; torchvision's shown ones."""
    from kdbench.models.catalogue import (
        CALLABLE_NOTE,
        FAMILY_NOTES,
        TORCHVISION_CLASSES,
        TORCHVISION_SHAPE,
        families,
        natural,
        tokens_text,
    )

    classes, shape = _data_defaults()
    rows = []
    for family in families(classes, shape):
        names = family.models
        if family.name == "torchvision":
            names = tuple(sorted((k for k in TORCHVISION_SHOWN if k in names), key=natural))
        counted = f"{family.num_classes} classes, {_shape(family.shape)}" if family.shape else "its registered config"
        for name in names:
            count = family.parameters(name)
            tokens = family.tokens(name)
            sizes = tokens_text(tokens) if tokens else NONE
            rows.append((code(name), family.name, f"{count:,}", f"{count / 1e6:.2f} M", counted, sizes))
    lead = (
        f"Parameters as built for the cell defaults ({classes} classes, {_shape(shape)} inputs; "
        f"`data.num_classes`, `data.shape`), torchvision's classifiers for ImageNet ({TORCHVISION_CLASSES} classes, "
        f"{_shape(TORCHVISION_SHAPE)}). A model's count changes with the classes (its head) and, for ViTs, "
        "the image size."
    )
    header = ["model", "family", "parameters", "millions", "counted for", "tokens (`data.seq_len` ≤ positions)"]
    lines = [lead, "", *table(header, rows)]
    lines += [
        "",
        f"lm: {FAMILY_NOTES['lm']}",
        "",
        f"encoder: {FAMILY_NOTES['encoder']} ([lm.md](lm.md)).",
        "",
        "torchvision: the models above, and every other classification model of the installed torchvision "
        "(`torchvision.models.list_models(module=torchvision.models)`; `kdbench list models` lists them).",
        "",
        f"{CALLABLE_NOTE}.",
    ]
    return "\n".join(lines)


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(str(d) for d in shape)


def results_columns() -> str:
    from kdbench.core.schema import schema_markdown

    return schema_markdown()
