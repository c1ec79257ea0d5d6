"""The import name ``fabric`` is shared with the SSH library Fabric: a collision is an error that names it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import fabric
import fabric_cli

REPOSITORY = Path(__file__).resolve().parents[2]


def _python(code: str, path: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(entry) for entry in path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=path[0])


def test_the_cli_names_another_fabric_found_first(tmp_path: Path) -> None:
    ssh_library = tmp_path / "fabric"
    ssh_library.mkdir()
    (ssh_library / "__init__.py").write_text("__version__ = '3.2.2'\nclass Connection: ...\n")
    result = _python("import fabric_cli.cli", [tmp_path, REPOSITORY])
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"ImportError: `import fabric` found {ssh_library / '__init__.py'}, which is not")
    assert "The SSH library Fabric (pip install fabric) uses the same import name" in last_line


def test_the_ssh_library_installed_over_this_package_is_refused(tmp_path: Path) -> None:
    package = tmp_path / "fabric"
    shutil.copytree(REPOSITORY / "fabric", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "connection.py").write_text("class Connection: ...\n")
    result = _python("import fabric", [tmp_path])
    assert result.returncode == 1
    assert f"{package} holds files of two packages" in result.stderr
    assert "(connection.py); pip installed one over the other" in result.stderr
    assert "pip uninstall -y fabric torch-fabric" in result.stderr


def test_this_package_is_recognised() -> None:
    assert fabric.__distribution__ == fabric_cli.EXPECTED_DISTRIBUTION == "torch-fabric"
    result = _python("import fabric, fabric_cli.cli; print(fabric.__file__)", [REPOSITORY])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(REPOSITORY / "fabric" / "__init__.py")
