"""``python -m kdbench``: the command line (:mod:`kdbench.cli`)."""

from kdbench.cli import main

if __name__ == "__main__":  # guarded: spawned worker processes import this module too
    raise SystemExit(main())
