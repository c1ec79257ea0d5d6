"""Every moved module's old import path still works, as the module at its new path, warning once with that path."""

from __future__ import annotations

import json
import subprocess
import sys

from fabric.utilities.moved_modules import MOVED

PROBE = """
import importlib, json, sys, warnings
from fabric.utilities.moved_modules import MOVED
results = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        importlib.import_module(old)  # a second import: no second warning
    results[old] = {
        "same": module is importlib.import_module(new),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }
print(json.dumps(results))
"""


def test_old_paths_import_the_moved_module_with_one_warning_naming_its_new_path() -> None:
    """``from fabric.trainer.callback import Callback`` (and the other moved modules) raised ModuleNotFoundError."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)
    for old, new in MOVED.items():
        assert results[old] == {
            "same": True,
            "warnings": [
                f"FutureWarning: {old} moved to {new}: import it from there (the old path goes in a later release)."
            ],
        }, old


def test_the_old_path_of_a_moved_class_gives_the_same_class() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "ignore::FutureWarning", "-c",
         "from fabric.trainer.callback import Callback; from fabric.trainer.core.callback import Callback as New; "
         "print(Callback is New)"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout.strip()) == (0, "True"), result.stderr
