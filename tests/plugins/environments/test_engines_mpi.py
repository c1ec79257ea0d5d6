"""Fabric under real MPI launchers: OpenMPI's ``mpirun -np 2`` and MPICH's ``mpiexec -n 2`` (each in a network
namespace of its own) start one world whose ranks, local ranks and node ranks are right, and train it."""

from __future__ import annotations

import shlex
from pathlib import Path

import engines
import pytest
from engines import MpiLaunchers
from worlds import WORLD, assert_one_world_trained, reports

#: Slow: real OpenMPI and MPICH jobs (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

mpi_launchers = engines.mpi_launchers
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("flavour", ["openmpi", "mpich"])
def test_mpi_ranks_train_as_one_world_on_one_node(mpi_launchers: MpiLaunchers, tmp_path: Path, flavour: str) -> None:
    """Rank 1 of a one-node `mpirun -np 2` (OpenMPI) reported node 1: OMPI_COMM_WORLD_NODE_RANK is the rank within
    the node, not the node's index. MPICH was right; both are checked."""
    launch = mpi_launchers.openmpi if flavour == "openmpi" else mpi_launchers.mpich
    result = mpi_launchers.run(launch(["python", WORLD, str(tmp_path)]))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = reports(tmp_path, 2)
    assert_one_world_trained(ranks, 2)
    assert {r["environment"] for r in ranks} == {"MPIEnvironment"}
    assert [(r["local_rank"], r["node_rank"]) for r in ranks] == [(0, 0), (1, 0)]
    assert {r["variables"]["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}


def test_mpi_ranks_with_contradicting_devices_fail_naming_both(mpi_launchers: MpiLaunchers, tmp_path: Path) -> None:
    result = mpi_launchers.run(mpi_launchers.mpich(["python", WORLD, str(tmp_path), "devices=1"]))
    assert result.returncode != 0
    expected = "mpirun started 2 processes, 2 on this node, but Fabric(devices=1, num_nodes=1)"
    # every rank fails so, but mpiexec stops the others at the first failure: a slow rank may not get to say it
    assert expected in result.stderr, result.stderr[-3000:]


def _documented_mpi_commands() -> list[tuple[str, str]]:
    """Every ``mpirun``/``mpiexec`` command line in the README and the multi-node guide, with its page."""
    commands = []
    for page in (ROOT / "README.md", ROOT / "docs" / "multi-node.md"):
        for line in page.read_text().splitlines():
            if line.startswith(("mpirun ", "mpiexec")):
                commands.append((page.name, line.split("#", 1)[0].strip()))
    return commands


@pytest.mark.parametrize(("page", "command"), _documented_mpi_commands())
def test_the_documented_mpi_commands_run_as_written(
    mpi_launchers: MpiLaunchers, tmp_path: Path, page: str, command: str
) -> None:
    """As written, `mpirun -np 2 ...` refused to run as root and `mpiexec -n 2 -genv ...` was OpenMPI's (after
    scripts/install_engines.sh), which has no -genv."""
    engines.require_engine("the documented MPI launchers", shlex.split(command)[0])
    args = shlex.split(command.replace("<host of rank 0>", "127.0.0.1"))
    script = args.index("train.py")
    result = mpi_launchers.run([*args[:script], WORLD, str(tmp_path), *args[script + 1 :]])
    assert result.returncode == 0, f"{page}: {command}\n{result.stderr[-3000:]}"
    assert_one_world_trained(reports(tmp_path, 2), 2)
