"""``tests/`` mirrors the source folders: the tests of ``fabric/<path>/`` are in ``tests/<path>/`` (``fabric_cli``'s in
``tests/cli/``), so a newcomer finds a module's tests where the module is (docs/layout.md)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: Test folders that hold no source folder's tests: the jobs the tests start, and the GPU checks.
NOT_MIRRORS = {"scripts", "gpu"}


def _source_folders() -> dict[str, Path]:
    """Every package folder of the project, by the test folder that mirrors it."""
    folders = {"cli": ROOT / "fabric_cli"}
    for init in (ROOT / "fabric").rglob("__init__.py"):
        relative = init.parent.relative_to(ROOT / "fabric")
        if relative.parts:
            folders[relative.as_posix()] = init.parent
    return folders


def _test_folders() -> list[str]:
    folders = []
    for path in TESTS.rglob("*"):
        relative = path.relative_to(TESTS)
        if path.is_dir() and "__pycache__" not in relative.parts and relative.parts[0] not in NOT_MIRRORS:
            folders.append(relative.as_posix())
    return folders


def test_every_source_folder_has_its_test_folder() -> None:
    """Each folder with modules of its own (besides ``__init__.py``) has test files in its mirror."""
    missing = [
        name
        for name, folder in _source_folders().items()
        if any(module.name != "__init__.py" for module in folder.glob("*.py"))
        and not list((TESTS / name).glob("test_*.py"))
    ]
    assert missing == [], f"source folders without tests/<path>/test_*.py: {missing}"


def test_every_test_folder_mirrors_a_source_folder() -> None:
    sources = _source_folders()
    strays = [name for name in _test_folders() if name not in sources]
    assert strays == [], f"test folders that mirror no source folder: {strays}"


#: Top-level test files that test the project as a whole, not one module: its import graph, its folders, its
#: ``@override`` marks, its public names, its docs and examples, the GPU check script and the test isolation.
PROJECT_TESTS = {
    "test_docs.py",
    "test_examples.py",
    "test_gpu_check.py",
    "test_isolation.py",
    "test_layering.py",
    "test_mirroring.py",
    "test_overrides.py",
    "test_public_names.py",
}


def test_every_top_level_test_file_tests_a_top_level_module_or_the_project() -> None:
    """``tests/test_<module>[_<topic>].py`` holds the tests of ``fabric/<module>.py``; a module in a folder has its
    tests in that folder's mirror, and the project-wide checks are listed above."""
    modules = {path.stem for path in (ROOT / "fabric").glob("*.py") if path.name != "__init__.py"}
    strays = [
        path.name
        for path in TESTS.glob("test_*.py")
        if path.name not in PROJECT_TESTS
        and not any(path.stem == f"test_{module}" or path.stem.startswith(f"test_{module}_") for module in modules)
    ]
    assert strays == [], f"top-level test files of no top-level module (move them to their folder's mirror): {strays}"
