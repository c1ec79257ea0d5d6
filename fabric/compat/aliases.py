"""Answering another project's imports with this project's objects, from one table.

A table maps each module of the other project (``"lightning.fabric.strategies"``) to an :class:`AliasedModule`:
the module here whose public names answer the same names, names that live elsewhere here or under another name
(``"fabric.plugins.environments:LocalEnvironment"``), and names that have no counterpart, each :class:`Refused`
with a one-line reason that says what to use instead. A whole module may be refused too.

A refused name imports (as a stand-in) and raises its one line when it is used: called, subclassed or asked for an
attribute. Libraries import far more names at their top than a program uses (llm-foundry binds 94 of Composer's
at import), so a refusal at import would stop them before the program chose anything. ``isinstance(x, refused)``
is ``False``: nothing here is an instance of a class that has no counterpart. A refused module, or a name the table
does not know, is still an ``ImportError`` at import.

Two ways of applying it:

- :class:`AliasFinder` (the other project is not installed): an import hook that serves every module of the table
  as an :class:`AliasModule`, whose names resolve on first use. A module or name the table does not know is an
  :class:`ImportError` naming it and where the mapping is documented.
- :func:`overlay` (the other project is installed and must keep working for its own parts): its modules are
  imported as they are, then the table's names, and every other public name of those modules, are set on them,
  to this project's objects or to :class:`RefusedName` stand-ins. Code of the other project that bound names
  at its own import keeps its own objects; a program importing afterwards gets ours.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override


@dataclass(frozen=True)
class Refused:
    """A name (or module) with no counterpart here: ``reason`` says why, and what to use instead, in one line."""

    reason: str


@dataclass(frozen=True)
class AliasedModule:
    """One module of the other project: ``ours`` answers its public names by the same names; ``names`` maps a name
    to ``"module:attribute"`` here or to a :class:`Refused`."""

    ours: str | None = None
    names: Mapping[str, str | Refused] = field(default_factory=dict)


Table = Mapping[str, "AliasedModule | Refused"]


class NotProvided(ImportError):
    """A name or module of the other project that this project does not answer (an ``ImportError``, so that
    ``from module import name`` shows this message rather than Python's generic one)."""


class RefusedName:
    """Stands for a name of the other project that has no counterpart here: calling it, subclassing it or asking it
    for an attribute raises the one-line refusal; ``isinstance``/``issubclass`` against it are ``False``."""

    def __init__(self, error: NotProvided) -> None:
        object.__setattr__(self, "_error", error)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise object.__getattribute__(self, "_error")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and name != "__mro_entries__":
            # Python's own probes (typing's ``Optional[name]``, copy, pickle) see a plain object
            raise AttributeError(name)
        raise object.__getattribute__(self, "_error")  # ``__mro_entries__`` too: subclassing raises the refusal

    def __instancecheck__(self, instance: object) -> bool:
        return False

    def __subclasscheck__(self, subclass: type) -> bool:
        return False

    @override
    def __repr__(self) -> str:
        return f"<not provided: {object.__getattribute__(self, '_error')}>"


@dataclass(frozen=True)
class DropIn:
    """A drop-in mode: its table, the other project's name and the document that describes the table (for
    messages)."""

    table: Table
    project: str
    document: str

    def refusal(self, what: str, reason: str) -> NotProvided:
        return NotProvided(f"{what} is not provided by torch-fabric: {reason}")

    def unknown(self, what: str) -> NotProvided:
        return NotProvided(
            f"{what} has no counterpart in torch-fabric (its drop-in mode for {self.project}); {self.document} "
            "lists what is provided."
        )

    def resolve(self, module: str, name: str) -> Any:
        """What answers ``module.name``: ours, or a stand-in that refuses to be used; raises :class:`NotProvided`
        for a name the table does not know."""
        submodule = f"{module}.{name}"
        if submodule in self.table:
            return importlib.import_module(submodule)
        entry = self.table[module]
        assert isinstance(entry, AliasedModule)
        target = entry.names.get(name)
        if isinstance(target, Refused):
            return RefusedName(self.refusal(f"{module}.{name}", target.reason))
        if target is not None:
            where, _, attribute = target.partition(":")
            return getattr(importlib.import_module(where), attribute)
        if entry.ours is not None and not name.startswith("_"):
            ours = importlib.import_module(entry.ours)
            if name in getattr(ours, "__all__", ()) or hasattr(ours, name):
                return getattr(ours, name)
        raise self.unknown(f"{module}.{name}")

    def public_names(self, module: str) -> list[str]:
        """The names the table gives ``module``: its own entries and the public names of ``ours``."""
        entry = self.table[module]
        assert isinstance(entry, AliasedModule)
        names = set(entry.names)
        if entry.ours is not None:
            names |= set(getattr(importlib.import_module(entry.ours), "__all__", ()))
        return sorted(names)


class AliasModule(types.ModuleType):
    """Stands for a module of the other project; each name is resolved through the table on first use."""

    def __init__(self, name: str, drop_in: DropIn) -> None:
        super().__init__(name, f"Answered by torch-fabric's drop-in mode for {drop_in.project}.")
        self._fabric_drop_in = drop_in
        self.__path__: list[str] = []  # a package: its submodules are found through the finder too

    @override
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = self._fabric_drop_in.resolve(self.__name__, name)
        setattr(self, name, value)
        return value

    @override
    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._fabric_drop_in.public_names(self.__name__)})


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every module under ``roots`` (e.g. ``lightning``) from the table, refusing the others by name."""

    def __init__(self, drop_in: DropIn, roots: Sequence[str]) -> None:
        self.drop_in, self.roots = drop_in, tuple(roots)

    @override
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not any(fullname == root or fullname.startswith(root + ".") for root in self.roots):
            return None
        entry = self.drop_in.table.get(fullname)
        if isinstance(entry, Refused):
            raise self.drop_in.refusal(fullname, entry.reason)
        if entry is None:
            raise self.drop_in.unknown(fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    @override
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return AliasModule(spec.name, self.drop_in)

    @override
    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the names resolve on first use."""


def install_finder(drop_in: DropIn, roots: Sequence[str]) -> AliasFinder:
    """Put an :class:`AliasFinder` first on ``sys.meta_path`` (for a process that runs the other project's program)."""
    finder = AliasFinder(drop_in, roots)
    sys.meta_path.insert(0, finder)
    return finder


def overlay(drop_in: DropIn, keep: Mapping[str, Sequence[str]] | None = None) -> None:
    """Set the table's answers on the installed modules of the other project (imported first, as they are).

    Every name in a module's ``__all__`` or its table entry, and every name it shares with the module of ours that
    answers it, gets ours or a refusing stand-in, except the names ``keep[module]`` lists (the other project's own
    parts, e.g. ``lightning.LightningModule``).
    """
    keep = keep or {}
    for module_name, entry in drop_in.table.items():
        if isinstance(entry, Refused):
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a module of the table that this version of the other project does not have
        kept = set(keep.get(module_name, ()))
        ours = {name for name in drop_in.public_names(module_name) if hasattr(module, name)}
        names = {*getattr(module, "__all__", ()), *entry.names, *ours} - kept
        for name in sorted(names):
            if f"{module_name}.{name}" in drop_in.table:
                continue  # a submodule: overlaid in its own right
            try:
                value = drop_in.resolve(module_name, name)
            except NotProvided as error:
                value = RefusedName(error)
            setattr(module, name, value)
