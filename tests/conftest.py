"""Shared test fixtures: every test starts with no CLI variables set and global rank 0; the ``isolated`` marker;
``s3_server``/``s3_bucket`` (a real S3 API, see ``object_store.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from isolation import pytest_configure, pytest_pyfunc_call  # noqa: F401 - hooks: the ``isolated`` marker
from object_store import s3_bucket, s3_server  # noqa: F401 - fixtures: a real S3 API (moto's server)

from fabric.utilities.cli_contract import CLI_MARKER, CLI_SETTINGS
from fabric.utilities.rank_zero import set_global_rank

#: What a distributed Fabric exports in its process (the rank variables, the socket interface).
EXPORTED_BY_FABRIC = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_fabric_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (CLI_MARKER, *CLI_SETTINGS.values()):
        monkeypatch.delenv(name, raising=False)
    exported = {name: os.environ.get(name) for name in EXPORTED_BY_FABRIC}
    set_global_rank(0)
    yield
    set_global_rank(0)
    for name, value in exported.items():  # a test's Fabric never torn down must not make the next one "launched"
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
