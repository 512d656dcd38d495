"""kdbench: benchmark and profile knowledge distillation in PyTorch."""

import time

STARTED = time.time()  # when the interpreter first imported kdbench: where a run's wall-time split begins

from kdbench.core.errors import KdbenchError  # noqa: E402

__version__ = "0.1.0"

__all__ = ["STARTED", "KdbenchError", "__version__"]
