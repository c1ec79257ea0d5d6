"""Every method that overrides a base class's is marked ``@override``: a renamed base method then fails mypy
instead of leaving the subclass's method silently uncalled."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    paths = [*REPOSITORY.glob("fabric/**/*.py"), *REPOSITORY.glob("fabric_cli/**/*.py")]
    names = {".".join(path.relative_to(REPOSITORY).with_suffix("").parts).removesuffix(".__init__") for path in paths}
    return sorted(names)


def _function(attribute: object) -> object:
    if isinstance(attribute, property):
        return attribute.fget
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    return attribute


def _unmarked_overrides(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    unmarked = []
    for class_name, cls in vars(module).items():
        if not inspect.isclass(cls) or cls.__module__ != module_name:
            continue
        for name, attribute in vars(cls).items():
            function = _function(attribute)
            if not inspect.isfunction(function) or (name.startswith("__") and name.endswith("__")):
                continue
            if function.__qualname__ != f"{cls.__qualname__}.{name}":  # not written in this class (Enum adds some)
                continue
            overridden = any(name in vars(base) for base in cls.__mro__[1:] if base is not object)
            if overridden and not getattr(function, "__override__", False):
                unmarked.append(f"{class_name}.{name}")
    return unmarked


def test_every_override_is_marked() -> None:
    unmarked = [f"{name}: {method}" for name in _modules() for method in _unmarked_overrides(name)]
    assert unmarked == [], "add @override (from typing_extensions) to: " + ", ".join(unmarked)
