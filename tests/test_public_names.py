"""The public surface: every package of ``fabric`` and ``fabric_cli`` lists what users import from it in ``__all__``
(an empty list where it exports nothing by design), and every name listed imports (docs/layout.md, "Moving a
module")."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _packages() -> list[str]:
    """Every package (a folder with ``__init__.py``) under ``fabric/`` and ``fabric_cli/``, by its import name."""
    inits = [*(ROOT / "fabric").rglob("__init__.py"), *(ROOT / "fabric_cli").rglob("__init__.py")]
    return sorted(".".join(init.parent.relative_to(ROOT).parts) for init in inits if "__pycache__" not in init.parts)


PACKAGES = _packages()


def test_the_walk_finds_the_packages() -> None:
    assert {"fabric", "fabric.trainer", "fabric.strategies", "fabric_cli"} <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_lists_its_public_names_once_and_each_imports(package: str) -> None:
    module = importlib.import_module(package)
    listed = getattr(module, "__all__", None)
    assert isinstance(listed, list), f"{package} has no __all__ list (an empty one where it exports nothing)"
    assert all(isinstance(name, str) for name in listed), f"{package}.__all__ holds a non-string: {listed}"
    duplicates = sorted({name for name in listed if listed.count(name) > 1})
    assert duplicates == [], f"{package}.__all__ lists {duplicates} more than once"
    missing = [name for name in listed if not hasattr(module, name)]  # lazy names load here (PEP 562)
    assert missing == [], f"{package}.__all__ lists {missing}, which do not import"
    for name in listed:
        namespace: dict[str, object] = {}
        exec(f"from {package} import {name}", namespace)  # what users type
        assert namespace[name] is getattr(module, name)
