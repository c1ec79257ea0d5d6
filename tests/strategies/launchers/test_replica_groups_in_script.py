"""``python train.py`` whose fault-tolerant strategy is told the number of replica groups but not its own: the
process becomes the run's launcher (:class:`fabric.strategies.launchers.replica_groups.ReplicaGroupsLauncher`),
starting torchft's lighthouse and every group on this machine, as ``fabric run model --replica-groups=N`` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fabric.utilities.cli_contract import FT_LIGHTHOUSE, FT_REPLICA_GROUPS
from tests.engines import REPOSITORY, launcher_environment, require_modules

WORKER = str(REPOSITORY / "tests" / "scripts" / "ft_replica_group.py")


def _run_script(directory: Path, variables: dict[str, str], *options: str) -> subprocess.CompletedProcess[str]:
    """``python ft_replica_group.py`` with ``variables`` (no launcher's), as a user runs a script."""
    return subprocess.run(
        [sys.executable, WORKER, str(directory), str(directory / "stop"), *options],
        env=launcher_environment({**variables, "OMP_NUM_THREADS": "1"}),
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _records(directory: Path) -> list[dict[str, object]]:
    lines = [line for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]
    return [json.loads(line) for line in lines]


@pytest.mark.end_to_end
def test_python_script_starts_the_lighthouse_and_every_group_which_train_together(tmp_path: Path) -> None:
    require_modules("fault tolerance", "torchft")
    (tmp_path / "stop").write_text("12")
    job = _run_script(tmp_path, {FT_REPLICA_GROUPS: "2"}, "--devices=2", "--seed=3")
    assert job.returncode == 0, job.stderr[-4000:]
    assert "fabric: torchft lighthouse on 127.0.0.1:" in job.stderr
    records = _records(tmp_path)
    ranks = {(r["group"], r["rank"]) for r in records}
    assert ranks == {(0, 0), (0, 1), (1, 0), (1, 1)}  # two groups of two ranks, each rank its own process
    assert len({r["pid"] for r in records}) == 4 and job.stdout.count("done at step 12") == 2
    last = [r for r in records if r["committed_steps"] == 12]
    assert len(last) == 4 and {r["participants"] for r in last} == {2}  # the groups ended training together
    assert len({json.dumps(r["weights"]) for r in last}) == 1  # one model on every rank of every group


@pytest.mark.end_to_end
def test_python_script_whose_groups_fail_ends_with_their_code_naming_each(tmp_path: Path) -> None:
    require_modules("fault tolerance", "torchft")
    (tmp_path / "stop").write_text("3")
    job = _run_script(tmp_path, {FT_REPLICA_GROUPS: "2", FT_LIGHTHOUSE: "127.0.0.1:9"})
    assert job.returncode == 1, job.stderr[-4000:]
    assert "torchft lighthouse on" not in job.stderr  # the lighthouse given is the groups'
    assert "The torchft lighthouse at http://127.0.0.1:9 is unreachable" in job.stderr
    assert "fabric: replica group 0 ended with exit code 1" in job.stderr
    assert "fabric: replica group 1 ended with exit code 1" in job.stderr


def test_under_a_launcher_a_process_without_its_group_is_refused_at_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun or SLURM started this process as a rank: it cannot start the groups, it must be one of them."""
    require_modules("fault tolerance", "torchft")
    from fabric import Fabric

    variables = {"TORCHELASTIC_RUN_ID": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0"}
    variables |= {"LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", FT_REPLICA_GROUPS: "2"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    fabric = Fabric(accelerator="cpu", strategy="fault_tolerant_ddp")
    with pytest.raises(ValueError, match=r"replica_group is not set: pass replica_group=I \(0 to 1"):
        fabric.launch()


def test_the_lighthouse_module_refuses_an_address_that_is_not_host_and_port() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fabric.strategies.fault_tolerant.lighthouse", "nowhere"],
        env=launcher_environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr.strip()) == (1, "fabric: error: 'nowhere' is not HOST:PORT.")
