"""The one registry type: names to entries, each name registered once, a lookup that fails with one line.

The doors a user extends kdbench through (models, distillation methods, token divergences, LM loss
implementations) are each a :class:`Registry`.  They behave alike because they are the same code: registering a
name twice is a ``ValueError`` (a programming mistake, found at import), and looking up a name that is not there
is a :class:`~kdbench.core.errors.KdbenchError` of one line that names the close names and the known ones (a
mistake in a suite, the user's to fix).  A registry is a ``dict``, so reading it (``in``, iteration in
registration order, ``items``) is plain dict reading.  Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kdbench.core.errors import KdbenchError, did_you_mean

T = TypeVar("T")


class Registry(dict[str, T]):
    """Entries of one ``kind`` by name, in registration order.

    ``unknown(name)`` writes the line a lookup of an unregistered ``name`` fails with; without it the line is
    ``unknown <kind> 'name': did you mean ...? choose one of <the names>`` (:meth:`choose`), with ``tail`` after
    the names.
    """

    def __init__(self, kind: str, unknown: Callable[[str], str] | None = None, tail: str = "") -> None:
        super().__init__()
        self.kind = kind
        self._unknown = unknown
        self._tail = tail

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` as ``name`` and return it; ValueError if ``name`` is taken."""
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a test's registration, undone)."""
        del self[name]

    def find(self, name: str) -> T:
        """The entry called ``name``; a one-line KdbenchError naming the close and the known names otherwise."""
        if name not in self:
            raise KdbenchError(self.unknown(name))
        return self[name]

    def unknown(self, name: str) -> str:
        """The line a lookup of ``name`` fails with."""
        if self._unknown is not None:
            return self._unknown(name)
        return f"unknown {self.kind} {name!r}: {self.choose(name)}{self._tail}"

    def choose(self, name: str) -> str:
        """``did you mean 'a', 'b'? choose one of a, b, c``: the names close to ``name``, then every name."""
        return f"{did_you_mean(name, self, quote=True)}choose one of {', '.join(self)}"

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self)})"
