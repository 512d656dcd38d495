"""Model zoo: CIFAR models of the distillation literature, torchvision classifiers,
a toy linear model and user models given as ``"module:callable"``."""

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
