"""One registry mechanism for what tidal looks up by name: passes, plan kinds, program builders.

A :class:`Registry` is a fixed table of named :class:`Entry` rows, in registration order. A row
names its object by a ``"module:attribute"`` reference, imported the first time the row is
looked up, so listing the names and descriptions imports nothing (``tidal passes`` stays
fast, without torch). The module a row imports comes from the table, never from the name being
looked up. A registry may also hold objects *registered by being defined*: its ``defined``
function names them at each lookup (plan classes: every subclass of ``Plan``, whose kind is
read when asked, so a class may set its own kind after definition).

Example:
    >>> from tidal.ir.registry import Entry, Registry
    >>> codecs = Registry("codec", (Entry("json", "json:dumps", "JSON text."),
    ...                             Entry("repr", "builtins:repr", "Python literal.")))
    >>> codecs.names(), "json" in codecs, codecs.descriptions()["repr"]
    (('json', 'repr'), True, 'Python literal.')
    >>> codecs.get("repr")(1.5)
    '1.5'
    >>> codecs.get("yaml")
    Traceback (most recent call last):
    ...
    tidal.ir.registry.RegistryError: unknown codec 'yaml' (registered: json, repr)
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Generic, Iterable, Mapping, Optional, TypeVar

from tidal.ir.errors import TidalError

T = TypeVar("T")


class RegistryError(TidalError, LookupError):
    """A name no registry row (or defined object) has, or a malformed table."""


@dataclass(frozen=True)
class Entry:
    """One row of a registry: ``name``, the ``"module:attribute"`` it stands for, and a
    one-paragraph ``description`` (what listings print, without importing ``module``)."""

    name: str
    ref: str
    description: str = ""

    def __post_init__(self):
        module, sep, attribute = self.ref.partition(":")
        if not (sep and module and attribute):
            raise RegistryError(f"registry entry {self.name!r}: ref {self.ref!r} is not "
                                f"'module:attribute'")

    @property
    def module(self) -> str:
        """The module the row imports on first lookup."""
        return self.ref.partition(":")[0]

    def load(self) -> Any:
        """The object the row names (importing its module; Python caches the import)."""
        module, _, attribute = self.ref.partition(":")
        found: Any = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
        return found


class Registry(Generic[T]):
    """Things of one ``sort`` by name: the rows of ``entries`` (in order, names unique), then
    the objects ``defined()`` names that no row holds."""

    def __init__(self, sort: str, entries: Iterable[Entry] = (),
                 defined: Optional[Callable[[], Iterable[tuple[str, T]]]] = None):
        self.sort = sort
        self.entries = tuple(entries)
        self._defined = defined
        names = [e.name for e in self.entries]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RegistryError(f"{sort} {twice[0]!r} is registered twice")

    def __repr__(self) -> str:
        return f"Registry({self.sort!r}, {len(self.entries)} entries)"

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order (imports nothing)."""
        defined = [name for name, _ in self._defined()] if self._defined else []
        return tuple(dict.fromkeys([e.name for e in self.entries] + defined))

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def descriptions(self) -> Mapping[str, str]:
        """Each row's description by name (read-only; imports nothing)."""
        return MappingProxyType({e.name: e.description for e in self.entries})

    def get(self, name: str) -> T:
        """The object registered as ``name`` (its row's module imported now); a
        ``RegistryError`` listing the registered names when there is none."""
        for e in self.entries:
            if e.name == name:
                return e.load()
        for defined_name, obj in self._defined() if self._defined else ():
            if defined_name == name:
                return obj
        known = ", ".join(self.names()) or "none"
        raise RegistryError(f"unknown {self.sort} {name!r} (registered: {known})")

    def items(self) -> tuple[tuple[str, T], ...]:
        """(name, object) of every row, loaded, then of every defined object no row holds."""
        rows = [(e.name, e.load()) for e in self.entries]
        held = {id(obj) for _, obj in rows}
        defined = [(n, obj) for n, obj in (self._defined() if self._defined else ())
                   if id(obj) not in held]
        return tuple(rows + defined)
