"""A tiny name -> factory registry, the single place where user-typed strings become classes.

Entries may name their class lazily as ``"package.module:ClassName"`` so that registering a strategy
backed by a heavy optional package (FSDP, DeepSpeed) costs nothing until it is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def unknown_choice(kind: str, value: object, accepted: Iterable[str]) -> ValueError:
    """The error for a ``kind`` value outside ``accepted``: one wording for every choice, naming all accepted values."""
    return ValueError(f"Unknown {kind} {value!r}. Accepted values: {', '.join(map(repr, accepted))}.")


@dataclass(frozen=True)
class RegistryEntry(Generic[T]):
    """One registered name: what to build and with which fixed keyword arguments."""

    name: str
    target: type[T] | Callable[..., T] | str
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def resolve_target(self) -> type[T] | Callable[..., T]:
        """Import a lazily named target (``"module:attr"``) or return the callable itself."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]

    def create(self, **kwargs: Any) -> T:
        """Build the object; ``kwargs`` add to (and may override) the registered ``init_kwargs``."""
        return self.resolve_target()(**{**self.init_kwargs, **kwargs})


class Registry(Generic[T]):
    """Maps names (and aliases) to :class:`RegistryEntry` objects for one kind of plugin."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, RegistryEntry[T]] = {}
        self._aliases: dict[str, str] = {}

    def register(
        self,
        name: str,
        target: type[T] | Callable[..., T] | str,
        *,
        description: str = "",
        aliases: tuple[str, ...] = (),
        override: bool = False,
        **init_kwargs: Any,
    ) -> None:
        """Register ``target`` under ``name``; re-registering a name needs ``override=True``."""
        for key in (name, *aliases):
            if not override and key in self:
                raise ValueError(f"{self.kind} {key!r} is already registered; pass override=True to replace it.")
        self._entries[name] = RegistryEntry(name, target, dict(init_kwargs), description)
        for alias in aliases:
            self._aliases[alias] = name

    def unregister(self, name: str) -> None:
        """Remove ``name`` and its aliases."""
        canonical = self.canonical_name(name)
        del self._entries[canonical]
        self._aliases = {alias: target for alias, target in self._aliases.items() if target != canonical}

    def canonical_name(self, name: str) -> str:
        """The registered name behind ``name`` (which may be an alias); a clear error if unknown."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise unknown_choice(self.kind, name, self.choices())

    def get(self, name: str) -> RegistryEntry[T]:
        return self._entries[self.canonical_name(name)]

    def create(self, name: str, **kwargs: Any) -> T:
        return self.get(name).create(**kwargs)

    def names(self) -> list[str]:
        """Registered names, without aliases, in registration order."""
        return list(self._entries)

    def choices(self) -> list[str]:
        """Every string a user may type: names followed by aliases."""
        return [*self._entries, *self._aliases]

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
