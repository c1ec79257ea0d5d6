"""Shared test fixtures: every test starts with no CLI variables set and global rank 0; the ``isolated`` marker;
the ``cuda`` marker (real-GPU tests, skipped without a CUDA GPU); ``s3_server``/``s3_bucket`` (a real S3 API, see
``object_store.py``); ``group_of_one`` (a gloo process group of this process alone)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from file_timing import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401 - hooks: the slowest files
from isolation import pytest_configure, pytest_pyfunc_call  # noqa: F401 - hooks: the ``isolated`` marker
from mlflow_server import mlflow_server  # noqa: F401 - fixture: a real MLflow tracking server
from object_store import s3_bucket, s3_server  # noqa: F401 - fixtures: a real S3 API (moto's server)

from fabric.utilities.cli_contract import CLI_MARKER, CLI_SETTINGS
from fabric.utilities.rank_zero import set_global_rank

#: What a distributed Fabric exports in its process (the rank variables, the socket interface).
EXPORTED_BY_FABRIC = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                      "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # fmt: skip


#: Why a test marked ``cuda`` (``tests/gpu/``) is skipped on a machine without a CUDA GPU.
NO_CUDA_REASON = "needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``cuda`` where ``torch.cuda.is_available()`` is False (asked only if one was collected)."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if marked and not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA_REASON))


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


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (world size 1), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()
