"""The slowest test files at the end of a run: the seconds each file's tests took (setup, call and teardown).

``--durations`` names single tests; the suite's time is mostly many process-starting tests spread over a few files,
so a person looking for what makes the run long needs the totals per file. ``tests/conftest.py`` loads this hook;
``FABRIC_TEST_SLOWEST_FILES`` sets how many files are listed (default 15, 0 lists none).
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

_seconds_per_file: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_per_file[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    count = int(os.environ.get("FABRIC_TEST_SLOWEST_FILES", "15"))
    if count <= 0 or not _seconds_per_file:
        return
    total = sum(_seconds_per_file.values())
    slowest = sorted(_seconds_per_file.items(), key=lambda item: item[1], reverse=True)[:count]
    terminalreporter.write_sep("=", f"slowest {len(slowest)} files (of {len(_seconds_per_file)}; {total:.0f} s in all)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
