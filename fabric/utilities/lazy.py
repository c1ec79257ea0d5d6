"""Lazy package exports (PEP 562), so that importing a package does not import torch or heavy backends."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that imports ``name`` from the module ``exports[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__


def install_hint(extra: str, packages: str) -> str:
    """How to install an optional extra: the packages themselves, or the extra from a checkout of this project
    (it is not on a package index, so ``pip install "torch-fabric[extra]"`` cannot work)."""
    return f'pip install {packages} (or, from a checkout of this project, pip install -e ".[{extra}]")'


class MissingConditionalImportError(ImportError):
    """An optional package a feature needs is not installed (Composer's name, which Composer programs raise)."""

    def __init__(self, extra_deps_group: str, conda_package: str | None = None, conda_channel: str | None = None):
        self.extra_deps_group, self.conda_package, self.conda_channel = extra_deps_group, conda_package, conda_channel
        super().__init__(
            f"The optional packages of {extra_deps_group!r} are not installed: pip install "
            f"{conda_package or extra_deps_group}."
        )
