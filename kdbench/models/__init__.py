"""Models built by name, with random weights, never downloaded: image classifiers (CIFAR models of the
distillation literature, torchvision's, a toy linear one; :mod:`.registry`), causal language models (:mod:`.lm`),
BERT-shaped encoders (:mod:`.encoders`), and user models given as ``"module:callable"``; served once to the CLI and
the docs by :mod:`.catalogue`."""

from kdbench.models import cifar, cifar_mobile  # noqa: F401  (register the CIFAR family)
from kdbench.models.cache import ModelCache
from kdbench.models.registry import (
    available_models,
    build_model,
    check_model_input,
    check_model_name,
    count_params,
    register_model,
)

__all__ = [
    "ModelCache",
    "available_models",
    "build_model",
    "check_model_input",
    "check_model_name",
    "count_params",
    "register_model",
]
