"""``python -m kdbench.docgen``: regenerate (or ``--check``) the docs' generated blocks."""

import sys

from kdbench.docgen import main

sys.exit(main())
