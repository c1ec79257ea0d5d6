"""The import graph: imports flow down the layers, and no module imports itself back through others."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Lower numbers are lower layers; a module may import its own layer and the ones below.
LAYERS = {
    "fabric.utilities": 0,
    "fabric.accelerators": 1,
    "fabric.plugins": 1,
    "fabric.loggers": 1,
    "fabric.strategies": 2,
    "fabric.wrappers": 3,
    "fabric.connector": 3,
    "fabric.fabric": 4,
    "fabric.trainer": 5,
    "fabric.compat": 5,
    "fabric_cli": 6,
}


#: The layers inside the Trainer (``fabric.trainer``), read the same way; a Trainer module not named here is in the
#: top layer (the Trainer itself and what only it uses: ``trainer``, ``evaluation``, ``stages``, ``train_step``, ...).
TRAINER_LAYERS = {
    "fabric.trainer.core": 0,  # events, state, time, engine, the Callback/Algorithm bases and the Logger facade
    "fabric.trainer.intervals": 0,
    "fabric.trainer.surgery": 0,
    "fabric.trainer.dist": 0,
    "fabric.trainer.devices": 0,
    "fabric.trainer.file_names": 0,
    "fabric.trainer.loggers": 1,
    "fabric.trainer.metrics": 1,
    "fabric.trainer.model": 1,
    "fabric.trainer.huggingface": 1,  # a model type, as model.py
    "fabric.trainer.microbatch": 1,
    "fabric.trainer.data_spec": 1,
    "fabric.trainer.export": 1,
    "fabric.trainer.checkpoint": 2,
    "fabric.trainer.callbacks": 2,
    "fabric.trainer.algorithms": 2,
    "fabric.trainer": 3,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str, layers: dict[str, int] = LAYERS) -> int | None:
    matches = [prefix for prefix in layers if module == prefix or module.startswith(prefix + ".")]
    return layers[max(matches, key=len)] if matches else None


def _project_imports(nodes: Iterable[ast.AST], package: str) -> set[str]:
    """The project modules (and names in them) that the import statements among ``nodes`` import, relative ones
    (``from .x import y``) resolved against ``package``, the package the importing module is in."""
    imported = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            imported.add(module)
            imported |= {f"{module}.{alias.name}" for alias in node.names}
    return {name for name in imported if name.split(".")[0] in ("fabric", "fabric_cli")}


def _package(path: Path) -> str:
    """The package ``path``'s module is in (a package's ``__init__`` is in the package itself)."""
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported: not those under ``if TYPE_CHECKING`` or in functions."""
    return _project_imports(ast.parse(path.read_text()).body, _package(path))


def _every_import(path: Path) -> set[str]:
    """Every module ``path`` may import: at import time, deferred inside functions, or under ``TYPE_CHECKING``."""
    return _project_imports(ast.walk(ast.parse(path.read_text())), _package(path))


def test_relative_imports_are_resolved_so_they_cannot_hide_an_upward_one() -> None:
    nodes = ast.parse("from ..trainer import Trainer\nfrom . import spam\nfrom .ddp import DDPStrategy").body
    assert _project_imports(nodes, "fabric.strategies") == {
        "fabric.trainer",
        "fabric.trainer.Trainer",
        "fabric.strategies",
        "fabric.strategies.spam",
        "fabric.strategies.ddp",
        "fabric.strategies.ddp.DDPStrategy",
    }


#: The import graphs checked: what importing a module imports, and every import it may ever run or type-check
#: with (a deferred import still couples the layers; a ``TYPE_CHECKING`` cycle still tangles the types).
IMPORT_KINDS: dict[str, Callable[[Path], set[str]]] = {"top-level": _top_level_imports, "every": _every_import}


def _graph(kind: str = "top-level") -> dict[str, set[str]]:
    files = [*ROOT.joinpath("fabric").rglob("*.py"), *ROOT.joinpath("fabric_cli").rglob("*.py")]
    modules = {_module_name(path): path for path in files}
    imports_of = IMPORT_KINDS[kind]
    return {name: {m for m in imports_of(path) if m in modules} for name, path in modules.items()}


@pytest.mark.parametrize("kind", IMPORT_KINDS)
@pytest.mark.parametrize("layers", [LAYERS, TRAINER_LAYERS], ids=["package", "trainer"])
def test_no_module_imports_a_higher_layer(kind: str, layers: dict[str, int]) -> None:
    violations = []
    for module, imports in _graph(kind).items():
        own = _layer(module, layers)
        for imported in imports:
            theirs = _layer(imported, layers)
            if own is not None and theirs is not None and theirs > own:
                violations.append(f"{module} (layer {own}) imports {imported} (layer {theirs})")
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("kind", IMPORT_KINDS)
def test_there_are_no_import_cycles(kind: str) -> None:
    graph = _graph(kind)
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append([*trail[trail.index(imported) :], imported] if imported in trail else [module, imported])
            elif imported not in state:
                visit(imported, [*trail, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # A package importing its own submodules is not a cycle unless a submodule imports the package back.
    real = [cycle for cycle in cycles if not all(step.startswith(cycle[0]) for step in cycle)]
    assert not real, "\n".join(" -> ".join(cycle) for cycle in real)
