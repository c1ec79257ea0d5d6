"""What the tests of every drop-in mode check of its table: each entry answers as written, and the migration doc
names each one."""

from __future__ import annotations

import importlib
import sys
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from fabric.compat.aliases import AliasedModule, DropIn, NotProvided, Refused, install_finder


@contextmanager
def served(drop_in: DropIn, roots: Sequence[str]) -> Iterator[None]:
    """The mode's finder on this process's ``sys.meta_path``; gone afterwards, with every module it served."""
    finder = install_finder(drop_in, roots=roots)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [name for name in sys.modules if any(name == r or name.startswith(f"{r}.") for r in roots)]:
            del sys.modules[name]


def table_entries(drop_in: DropIn) -> list[tuple[str, str, str | Refused]]:
    """Every named entry of the table: (module, name, what answers it)."""
    return [
        (module, name, target)
        for module, entry in drop_in.table.items()
        if isinstance(entry, AliasedModule)
        for name, target in entry.names.items()
    ]


def assert_answers(module: str, name: str, target: str | Refused) -> None:
    """``module.name`` is the object ``target`` names, or a stand-in that raises its one-line refusal when called,
    subclassed or asked for an attribute, and that nothing is an instance of."""
    if isinstance(target, Refused):
        exec(f"from {module} import {name}", namespace := {})
        refused_name = namespace[name]
        expected = f"{module}.{name} is not provided by torch-fabric: {target.reason}"
        assert "\n" not in expected
        for use in ("refused_name()", "refused_name.anything", "class Sub(refused_name): pass"):
            with pytest.raises(NotProvided) as refused:
                exec(use, {"refused_name": refused_name})
            assert str(refused.value) == expected
        assert not isinstance(object(), refused_name) and not issubclass(int, refused_name)
        assert typing.Optional[refused_name] == typing.Union[refused_name, None]  # noqa: UP007, UP045  # old-style annotations
    else:
        where, _, attribute = target.partition(":")
        assert getattr(importlib.import_module(module), name) is getattr(importlib.import_module(where), attribute)


def missing_from(drop_in: DropIn, document: str) -> list[str]:
    """The entries (named entries and modules) the migration doc does not name in backticks."""
    missing = [f"{module}.{name}" for module, name, _ in table_entries(drop_in) if f"`{name}`" not in document]
    return missing + [module for module in drop_in.table if f"`{module}`" not in document]
