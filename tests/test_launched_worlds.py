"""Processes a real launcher started join its world (torchrun on one node and across two network namespaces,
Fabric's own in-script launch): every rank trains on its share of the data, and has torch's rank variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engines import NodePair

from fabric.plugins.environments import find_free_port

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


def test_default_fabric_under_torchrun_joins_its_world(tmp_path: Path) -> None:
    """A default Fabric() under `torchrun --nproc-per-node=2` ran each process as a world of one, each training
    on all the data, silently."""
    command = [*TORCHRUN, "--nproc-per-node=2", f"--master-port={find_free_port()}", WORLD, str(tmp_path)]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    assert {r["environment"] for r in ranks} == {"TorchElasticEnvironment"}


def test_devices_that_contradict_torchrun_fail_on_every_rank_naming_both(tmp_path: Path) -> None:
    command = [*TORCHRUN, "--nproc-per-node=2", f"--master-port={find_free_port()}", WORLD, str(tmp_path), "devices=1"]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    expected = "torchrun started 2 processes, 2 on this node, but Fabric(devices=1, num_nodes=1)"
    # every rank fails so, but torchrun stops the others at the first failure: a slow rank may not get to say it
    assert expected in result.stderr, result.stderr[-3000:]
    assert "IndexError" not in result.stderr
    assert not list(tmp_path.glob("rank*.json"))


def test_every_rank_of_an_in_script_launch_has_the_torch_rank_variables(tmp_path: Path) -> None:
    """Rank 0 of `python train.py` with Fabric(devices=2) had no RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, so
    libraries that read only those (mosaicml-streaming, many data loaders) hung or split the data wrongly."""
    result = subprocess.run(
        [sys.executable, WORLD, str(tmp_path), "devices=2"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    for r in ranks:
        assert r["variables"]["LOCAL_WORLD_SIZE"] == "2"
        assert r["variables"]["MASTER_ADDR"] == "127.0.0.1"
    assert ranks[0]["variables"]["MASTER_PORT"] == ranks[1]["variables"]["MASTER_PORT"]


def test_torchrun_across_two_network_namespaces_trains_without_gloo_socket_ifname(tmp_path: Path) -> None:
    """Two "machines" whose hostnames resolve to loopback: with a c10d rendezvous, gloo advertised 127.0.0.1 and
    node 1 got `connectFullMesh ... Connection refused` (node 0 hung) unless GLOO_SOCKET_IFNAME was set by hand.
    Fabric now names the interface that routes to the main address itself."""
    with NodePair() as nodes:
        port = 29531
        endpoint = f"{nodes.address(0)}:{port}"
        commands = [
            nodes.command(
                node,
                [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                 "--rdzv-id=fabric-test", f"--local-addr={nodes.address(node)}",
                 *(["--rdzv-conf=is_host=true"] if node == 0 else []), WORLD, str(tmp_path)],
            )
            for node in range(2)
        ]  # fmt: skip
        started = [
            subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for command in commands
        ]
        outputs = [process.communicate(timeout=180) for process in started]
    assert [process.returncode for process in started] == [0, 0], [err[-2000:] for _, err in outputs]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    assert [r["node_rank"] for r in ranks] == [0, 1]
    assert [r["variables"]["GLOO_SOCKET_IFNAME"] for r in ranks] == [nodes.interface(0), nodes.interface(1)]
