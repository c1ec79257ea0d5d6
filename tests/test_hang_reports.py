"""Distributed hangs are refused up front or reported, bounded and named (issue 19): real processes, gloo."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric import Fabric

SCRIPTS = Path(__file__).parent / "scripts"
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in _RANK_VARIABLES}


@pytest.fixture
def no_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_rendezvous")
def test_several_nodes_without_a_main_address_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"num_nodes=2\).*MASTER_ADDR and MASTER_PORT are not set.*--main-address"):
        Fabric(accelerator="cpu", devices=1, num_nodes=2)


@pytest.mark.usefixtures("no_rendezvous")
def test_several_nodes_need_a_node_rank_inside_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("NODE_RANK", "2")
    with pytest.raises(ValueError, match=r"NODE_RANK=2 is outside \[0, 2\)"):
        Fabric(accelerator="cpu", devices=1, num_nodes=2)
    monkeypatch.setenv("NODE_RANK", "1")
    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=2)
    assert (fabric.node_rank, fabric.global_rank, fabric.world_size) == (1, 1, 2)


def test_a_ddp_script_read_from_stdin_is_refused_at_launch(tmp_path: Path) -> None:
    script = "from fabric import Fabric\nFabric(accelerator='cpu', strategy='ddp', devices=2).launch()\nprint('ran')\n"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60, env=_env(), cwd=tmp_path
    )
    assert time.monotonic() - start < 30
    assert result.returncode == 1 and "ran" not in result.stdout
    assert "`python - < script.py` cannot do" in result.stderr
