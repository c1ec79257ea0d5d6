"""Shared test fixtures: every test starts with no CLI variables set and global rank 0; the ``isolated`` marker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from isolation import pytest_configure, pytest_pyfunc_call  # noqa: F401 - hooks: the ``isolated`` marker

from fabric.utilities.cli_contract import CLI_MARKER, CLI_SETTINGS
from fabric.utilities.rank_zero import set_global_rank


@pytest.fixture(autouse=True)
def _clean_fabric_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (CLI_MARKER, *CLI_SETTINGS.values()):
        monkeypatch.delenv(name, raising=False)
    set_global_rank(0)
    yield
    set_global_rank(0)
