"""GPU check: what kdbench's GPU paths measure, checked on a real GPU in one device command.

    python benchmarks/gpu_check.py [--out DIR] [--quick] [--cell-timeout S] [--device cpu] [--skip STAGE...]

The command (docs/gpu-check.md); the check itself is the package beside it, benchmarks/gpu/ (its plan, its
report, one module per stage under checks/), imported as ``gpu``: running this file puts its folder first on
``sys.path``.  pytest does not collect it.
"""

import sys

from gpu.main import main

if __name__ == "__main__":
    sys.exit(main())
