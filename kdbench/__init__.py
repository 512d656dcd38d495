"""kdbench: benchmark and profile knowledge distillation in PyTorch."""

from kdbench.errors import KdbenchError

__version__ = "0.1.0"

__all__ = ["KdbenchError", "__version__"]
