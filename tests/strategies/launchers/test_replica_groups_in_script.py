"""``python train.py`` whose fault-tolerant strategy is told the number of replica groups but not its own: the
process becomes the run's launcher (:class:`fabric.strategies.launchers.replica_groups.ReplicaGroupsLauncher`),
starting torchft's lighthouse and every group on this machine, as ``fabric run model --replica-groups=N`` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fabric.utilities.cli_contract import FT_LIGHTHOUSE, FT_REPLICA_GROUPS
from tests.engines import REPOSITORY, launcher_environment, require_modules

WORKER = str(REPOSITORY / "tests" / "scripts" / "ft_replica_group.py")
TRAINER_WORKER = str(REPOSITORY / "tests" / "scripts" / "ft_trainer_group.py")


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
    # min_replica_groups=2: no step commits without both. Otherwise a group still starting joins when it is ready and
    # the first may train alone until then, or to the end (seen in CI, the machine busy).
    job = _run_script(tmp_path, {FT_REPLICA_GROUPS: "2"}, "--devices=2", "--seed=3", "--min-groups=2")
    assert job.returncode == 0, job.stderr[-4000:]
    assert "fabric: torchft lighthouse on 127.0.0.1:" in job.stderr
    records = _records(tmp_path)
    ranks = {(r["group"], r["rank"]) for r in records}
    assert ranks == {(0, 0), (0, 1), (1, 0), (1, 1)}  # two groups of two ranks, each rank its own process
    assert len({r["pid"] for r in records}) == 4 and job.stdout.count("done at step 12") == 2
    committed = [r for r in records if r["committed_steps"] == r["step"] + 1]  # not a try discarded for want of a peer
    assert len(committed) == 4 * 12 and {r["participants"] for r in committed} == {2}  # each step trained by both
    last = [r for r in records if r["committed_steps"] == 12]
    assert len(last) == 4
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


@pytest.mark.end_to_end
def test_sigterm_to_the_whole_job_lets_every_trainer_group_save_and_the_script_exits_75(tmp_path: Path) -> None:
    """A signal to the job's process group (a scheduler's preemption, ``timeout``, Ctrl-C) reaches the lighthouse
    too: it must keep the quorum until the groups have finished their step and saved (it had ended at once, and the
    groups waited on it until their quorum timed out)."""
    require_modules("fault tolerance", "torchft")
    (tmp_path / "stop").write_text("100000")
    with (tmp_path / "job.log").open("w") as log:
        job = subprocess.Popen(
            [sys.executable, TRAINER_WORKER, str(tmp_path), str(tmp_path / "stop")],
            env=launcher_environment({FT_REPLICA_GROUPS: "2", "OMP_NUM_THREADS": "1"}),
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a job under a scheduler
        )
    try:
        deadline = time.monotonic() + 240
        while not all(len(_records_of(tmp_path, group)) >= 3 for group in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGTERM)
        assert job.wait(timeout=240) == 75, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    output = (tmp_path / "job.log").read_text()
    for group in (0, 1):
        assert f"fabric: replica group {group} ended with exit code 75" in output
        last = max(r["batch"] for r in _records_of(tmp_path, group))
        assert (tmp_path / f"ckpt-group{group}" / f"ep0-ba{last}-rank0.pt").is_file()  # saved at its last batch


def _records_of(directory: Path, group: int) -> list[dict[str, Any]]:
    lines = [line for path in directory.glob(f"group{group}-*.jsonl") for line in path.read_text().splitlines()]
    return [json.loads(line) for line in lines if line.endswith("}")]


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
