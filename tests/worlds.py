"""What the launched-world tests share (tests/strategies/launchers and tests/plugins/environments): the job every
launcher starts (``scripts/launched_world.py``), the environment it starts from, and the check that one world
trained."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WORLD = str(Path(__file__).parent / "scripts" / "launched_world.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
#: What a test's own launcher must not inherit from the test process.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # fmt: skip


def clean_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}


def reports(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def assert_one_world_trained(ranks: list[dict], world_size: int, num_samples: int = 16) -> None:
    """Every rank is in one world of ``world_size``, saw its own share of the data, and ended identical."""
    assert [(r["rank"], r["world_size"], r["strategy"]) for r in ranks] == [
        (rank, world_size, "DDPStrategy") for rank in range(world_size)
    ]
    seen = [sample for r in ranks for sample in r["seen"]]
    assert sorted(seen) == list(range(num_samples)), "each sample trained once, by one rank"
    assert all(r["parameters"] == ranks[0]["parameters"] for r in ranks)
    for r in ranks:
        variables = r["variables"]
        assert (variables["RANK"], variables["WORLD_SIZE"]) == (str(r["rank"]), str(world_size))
        assert (variables["LOCAL_RANK"], variables["NODE_RANK"]) == (str(r["local_rank"]), str(r["node_rank"]))
