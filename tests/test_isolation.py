"""The ``isolated`` marker (tests/isolation.py): a native crash fails one test and the suite goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

_SUITE = """
import ctypes
import os

import pytest


@pytest.mark.isolated
def test_crashes():
    ctypes.string_at(0)  # reads address 0: SIGSEGV


@pytest.mark.isolated
def test_fails():
    assert 1 + 1 == 3, "arithmetic in the child"


@pytest.mark.isolated
def test_skips():
    pytest.skip("not here")


@pytest.mark.isolated
def test_passes_in_a_child(tmp_path):
    (tmp_path / "pid").write_text(str(os.getpid()))
    assert os.getpid() != int(os.environ["PARENT_PID"])


def test_after_the_crash_still_runs():
    assert True
"""


def test_a_crash_fails_one_test_naming_the_signal_and_the_rest_still_report(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(_SUITE)
    (tmp_path / "conftest.py").write_text(
        "import os\n"
        "from isolation import pytest_configure, pytest_pyfunc_call\n"
        "os.environ['PARENT_PID'] = str(os.getpid())\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_environment(), "PYTHONPATH": str(TESTS)},
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "2 failed, 2 passed, 1 skipped" in output, output
    assert "FAILED test_suite.py::test_crashes" in output
    assert "the test process died from SIGSEGV (signal 11): a native crash" in output
    assert "arithmetic in the child" in output
    assert "SKIPPED" in output and "not here" in output


def _environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
