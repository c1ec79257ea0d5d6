"""Processes a real launcher started join its world (torchrun on one node and across two network namespaces,
Fabric's own in-script launch): every rank trains on its share of the data, and has torch's rank variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from engines import NodePair
from worlds import TORCHRUN, WORLD, assert_one_world_trained, clean_env, reports

from fabric.plugins.environments import find_free_port


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


def test_a_fabric_of_one_device_built_after_joining_the_world_runs_on_its_own(tmp_path: Path) -> None:
    """litgpt's ``finetune_lora --devices 2`` merges the weights on rank 0 with ``Fabric(devices=1)`` after training,
    which Lightning allows; it was refused as contradicting the launcher. Once a process has joined its world, such
    a Fabric is a process of its own (world size 1, rank 0); the world it joined keeps working."""
    script = Path(__file__).parents[2] / "scripts" / "nested_single_fabric.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], env=clean_env(), capture_output=True,
                            text=True, timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = reports(tmp_path, 2)
    assert first["world_size"] == second["world_size"] == 2 and "nested" not in second
    nested = first["nested"]
    assert (nested["strategy"], nested["world_size"], nested["global_rank"]) == ("SingleDeviceStrategy", 1, 0)
    torch.manual_seed(0)
    assert nested["output"] == torch.nn.Linear(3, 2)(torch.ones(1, 3)).tolist()
