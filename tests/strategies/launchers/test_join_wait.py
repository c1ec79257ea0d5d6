"""Ranks that start apart still join: the wait to join the process group is not the collectives' timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from fabric.utilities.ports import find_free_port

JOB = """
import sys
from datetime import timedelta
import torch
from fabric import Fabric
from fabric.strategies.ddp import DDPStrategy

fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(timeout=timedelta(seconds=1)), devices=2)
fabric.launch()
print("sum", int(fabric.all_reduce(torch.tensor(fabric.global_rank + 1), reduce_op="sum")))
"""

#: How each environment the strategy may find itself in names the ranks (the port is filled in per test).
ENVIRONMENTS = {
    "fabric's own launcher": lambda rank: {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": "2"},
    "torchrun without its agent's store": lambda rank: {
        "TORCHELASTIC_RUN_ID": "join-wait",
        "LOCAL_RANK": str(rank),
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    },
}


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("environment", sorted(ENVIRONMENTS))
def test_a_rank_starting_after_the_collective_timeout_still_joins(environment: str) -> None:
    """Rank 1 starts three collective timeouts after rank 0 began hosting the rendezvous; both join and reduce.

    Before, the collectives' 1 s timeout also bounded the join: rank 0 died with "Timed out after 2 seconds
    waiting for clients" (it happened in the suite beside busy processes, where ranks start seconds apart)."""
    port = find_free_port()

    def start(rank: int) -> subprocess.Popen[str]:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **ENVIRONMENTS[environment](rank)}
        return subprocess.Popen(
            [sys.executable, "-c", JOB], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    first = start(0)
    deadline = time.monotonic() + 60
    while not _listening(port):  # rank 0 hosts the rendezvous once it got through its imports
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "rank 0 never started hosting the rendezvous"
        time.sleep(0.05)
    hosting_since = time.monotonic()
    while time.monotonic() - hosting_since < 3:  # three collective timeouts pass with rank 0 waiting alone
        time.sleep(0.1)
    second = start(1)
    outputs = [process.communicate(timeout=90) for process in (first, second)]
    for process, (stdout, stderr) in zip((first, second), outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
        assert "sum 3" in stdout
