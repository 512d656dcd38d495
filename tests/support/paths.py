"""Where the repository's folders are, for tests at any depth of ``tests/``."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/support: helpers, and the user models a worker imports by name
TESTS = SUPPORT.parent  # tests/: the malformed corpus (malformed/) and the test data (data/)
ROOT = TESTS.parent  # the repository: suites/, docs/, kdbench/, benchmarks/
