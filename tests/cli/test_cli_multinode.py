"""Several nodes: the CLIs join before any rank starts (or fail together, naming who is missing), and ranks
on machines whose hostname resolves to loopback still reach each other (two real network namespaces)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engines import NodePair

from fabric.plugins.environments import find_free_port
from fabric_cli.layout import Layout, resolve_layout

#: Slow: fabric run model across network namespaces (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

REPORT = str(Path(__file__).parents[1] / "scripts" / "cli_report.py")
FABRIC = [sys.executable, "-m", "fabric_cli", "run", "model"]


def _env() -> dict[str, str]:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    drop = (*launcher, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "BASE_RANK")
    return {key: value for key, value in os.environ.items() if key not in drop}


def _nodes(commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run one CLI per node at the same time; return how each ended."""
    started = [
        subprocess.Popen(
            command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tempfile.mkdtemp()
        )
        for command in commands
    ]
    results = []
    for process in started:
        stdout, stderr = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def test_a_node_that_never_joins_fails_every_waiting_node_naming_it() -> None:
    port = str(find_free_port())
    common = ["--devices", "1", "--num-nodes", "3", "--main-address", "127.0.0.1", "--main-port", port]
    # Node 1 waits longer than node 0, so however slowly the two start, it fails by node 0's verdict.
    node0, node1 = _nodes([[*FABRIC, *common, "--join-timeout", timeout, "--node-rank", str(rank), REPORT, "/"]
                           for rank, timeout in ((0, "1.5"), (1, "60"))])  # fmt: skip
    assert node0.returncode == 1 and node1.returncode == 1
    missing = "node(s) 2 did not join within --join-timeout=1.5 s (joined: 0, 1)"
    assert missing in node0.stderr and missing in node1.stderr  # node 1 hears why from node 0
    assert node0.stderr.count("\n") == 1, node0.stderr  # one line, no rank started
    alone = _nodes([[*FABRIC, *common, "--join-timeout", "0.5", "--node-rank", "2", REPORT, "/"]])[0]
    assert alone.returncode == 1
    assert f"node 0 at 127.0.0.1:{port} did not answer within --join-timeout=0.5 s" in alone.stderr


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ([["--num-nodes", "2", "--node-rank", "0"], ["--num-nodes", "3", "--node-rank", "1"]],
         "node 1 (ranks 1..1) has --world-size=3 --num-nodes=3, node 0 has --world-size=2 --num-nodes=2"),
        ([["--num-nodes", "3", "--node-rank", str(rank)] for rank in (0, 1, 1)], "two nodes call themselves node 1"),
        ([["--num-nodes", "3", "--world-size", "6", "--node-rank", str(rank), *extra]
          for rank, extra in enumerate([[], ["--base-rank", "1"], ["--devices", "2"]])],
         "every node joined, but ranks 2, 3 of --world-size=6 are on no node"),
    ],
)  # fmt: skip
def test_nodes_that_disagree_all_fail_before_starting_ranks(nodes: list[list[str]], expected: str) -> None:
    port = str(find_free_port())
    common = ["--devices", "1", "--main-address", "127.0.0.1", "--main-port", port, "--join-timeout", "30"]
    results = _nodes([[*FABRIC, *common, *node, REPORT, "/"] for node in nodes])
    for result in results:
        assert result.returncode == 1 and expected in result.stderr, result.stderr


def test_uneven_nodes_in_composers_form_number_themselves_when_they_join(tmp_path: Path) -> None:
    """Composer's launcher form names no node count: `--world_size 3` on a node of two processes and
    `--world_size 3 --base_rank 2` on a node of one. Node 0 refused it ("not a multiple"), and node 1 took itself
    for one of three nodes; Fabric on the smaller node then refused a layout it could not tell from an even one."""
    port = str(find_free_port())
    common = ["--main-address", "127.0.0.1", "--main-port", port, "--join-timeout", "60"]
    nodes = _nodes([
        [*FABRIC, "--devices", "2", "--world_size", "3", *common, "--run-dir", str(tmp_path / "run0"), REPORT,
         str(tmp_path)],
        [*FABRIC, "--devices", "1", "--world_size", "3", "--base_rank", "2", *common, "--run-dir",
         str(tmp_path / "run1"), REPORT, str(tmp_path)],
    ])  # fmt: skip
    assert [node.returncode for node in nodes] == [0, 0], [node.stderr[-2000:] for node in nodes]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert [(r["rank"], r["local_rank"], r["node_rank"], r["world_size"], r["num_nodes"]) for r in reports] == [
        (0, 0, 0, 3, 2),
        (1, 1, 0, 3, 2),
        (2, 0, 1, 3, 2),
    ]
    assert [r["sum"] for r in reports] == [6, 6, 6]  # one world of three ranks


def test_nodes_without_a_node_count_fail_naming_the_ranks_no_node_started(tmp_path: Path) -> None:
    port = str(find_free_port())
    common = ["--world_size", "4", "--main-address", "127.0.0.1", "--main-port", port]
    node0, node1 = _nodes([
        [*FABRIC, "--devices", "2", *common, "--join-timeout", "1.5", REPORT, "/"],
        [*FABRIC, "--devices", "1", "--base_rank", "3", *common, "--join-timeout", "60", REPORT, "/"],
    ])  # fmt: skip
    missing = "no node with ranks 2 of --world-size=4 joined within --join-timeout=1.5 s (joined: node 0 (ranks 0..1)"
    assert node0.returncode == 1 and missing in node0.stderr, node0.stderr
    assert node1.returncode == 1 and missing in node1.stderr, node1.stderr
    overlapping = _nodes([
        [*FABRIC, "--devices", "2", "--world_size", "3", *common[2:], "--join-timeout", "30", REPORT, "/"],
        [*FABRIC, "--devices", "2", "--world_size", "3", "--base_rank", "1", *common[2:], REPORT, "/"],
    ])  # fmt: skip
    for result in overlapping:
        assert result.returncode == 1
        assert "the node of ranks 1..2 and node 0 (ranks 0..1) overlap: fix --base-rank or --devices" in result.stderr


@pytest.fixture
def two_namespaces() -> Iterator[tuple[str, str]]:
    with NodePair() as nodes:
        yield nodes.names


def test_two_nodes_in_separate_network_namespaces_train_together(
    tmp_path: Path, two_namespaces: tuple[str, str]
) -> None:
    """Each namespace's hostname resolves to 127.0.0.1, so gloo would advertise loopback and node 1 would be
    refused; the CLI sets GLOO_SOCKET_IFNAME to the veth interface that routes to the main address."""
    subnet = f"198.18.{os.getpid() % 250}"
    common = ["--devices", "1", "--num-nodes", "2", "--main-address", f"{subnet}.1", "--main-port", "29517"]
    nodes = _nodes([
        ["ip", "netns", "exec", space, *FABRIC, *common, "--node-rank", str(rank), "--run-dir",
         str(tmp_path / f"run{rank}"), REPORT, str(tmp_path)]
        for rank, space in enumerate(two_namespaces)
    ])  # fmt: skip
    assert [node.returncode for node in nodes] == [0, 0], [node.stderr[-2000:] for node in nodes]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["node_rank"], r["world_size"], r["sum"]) for r in reports] == [(0, 0, 2, 3), (1, 1, 2, 3)]
    assert [r["env"]["GLOO_SOCKET_IFNAME"] for r in reports] == [
        f"fvA{os.getpid() % 100000}",
        f"fvB{os.getpid() % 100000}",
    ]


def _start_node(rank: int, port: str, out_dir: Path) -> subprocess.Popen[str]:
    command = [*FABRIC, "--devices", "1", "--num-nodes", "2", "--node-rank", str(rank), "--main-address", "127.0.0.1",
               "--main-port", port, "--join-timeout", "60", "--run-dir", str(out_dir / f"run{rank}"), REPORT,
               str(out_dir)]  # fmt: skip
    return subprocess.Popen(
        command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tempfile.mkdtemp()
    )


def _connect_when_listening(port: int) -> socket.socket:
    """A connection to node 0's join port, once it listens (node 0 takes a moment to start)."""
    for _ in range(600):
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            time.sleep(0.1)
    raise AssertionError(f"node 0 never listened on {port}")


def _join_message(node_rank: int) -> bytes:
    layout = resolve_layout(1, world_size=None, num_nodes=2, node_rank=node_rank, base_rank=None)
    return (json.dumps({name: getattr(layout, name) for name in Layout.__dataclass_fields__}) + "\n").encode()


@pytest.mark.parametrize("visitor", ["probes", "a node that joined and died"])
def test_node_zero_counts_only_live_nodes_that_sent_a_join_message(tmp_path: Path, visitor: str) -> None:
    """A connect-and-close probe on node 0's port (a port scan, a health check) aborted the whole job; a node that
    checked in and then died was still counted, and the live ranks hung in the rendezvous for 30 minutes."""
    port = find_free_port()
    node0 = _start_node(0, str(port), tmp_path)
    if visitor == "probes":
        _connect_when_listening(port).close()
        with _connect_when_listening(port) as garbage:
            garbage.sendall(b"GET / HTTP/1.0\r\n\r\n")
    else:
        with _connect_when_listening(port) as ghost:
            ghost.sendall(_join_message(1))  # joins as node 1, then goes away before node 0 answers
    node1 = _start_node(1, str(port), tmp_path)
    results = [node.communicate(timeout=120) for node in (node0, node1)]
    assert [node0.returncode, node1.returncode] == [0, 0], [stderr[-2000:] for _, stderr in results]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["world_size"], r["sum"]) for r in reports] == [(0, 2, 3), (1, 2, 3)]
