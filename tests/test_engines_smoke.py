"""The engine fixtures of ``tests/engines.py`` work: SLURM starts ranks with this interpreter, runs batch jobs and
``salloc`` commands and delivers ``scancel --signal``; OpenMPI and MPICH start two ranks with their rank variables."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import engines
from engines import MpiLaunchers, SlurmCluster, stop_process

slurm_cluster = engines.slurm_cluster  # the fixtures this module uses
mpi_launchers = engines.mpi_launchers

#: Prints the task's variables whose names start with one of its arguments, as one JSON line.
PRINT_VARIABLES = """
import json, os, sys
prefixes = tuple(sys.argv[1:])
print(json.dumps({k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}), flush=True)
"""


def _printed(stdout: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_srun_starts_one_task_per_rank_in_a_step(slurm_cluster: SlurmCluster) -> None:
    names = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_ID"]  # srun splits lines over 1 KiB
    result = slurm_cluster.run(["srun", "-n", "2", "python", "-c", PRINT_VARIABLES, *names])
    assert result.returncode == 0, result.stderr
    tasks = sorted(_printed(result.stdout), key=lambda task: task["SLURM_PROCID"])
    assert [(task["SLURM_PROCID"], task["SLURM_LOCALID"], task["SLURM_NTASKS"]) for task in tasks] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert all(task["SLURM_STEP_ID"] == "0" for task in tasks)


def test_srun_tasks_get_this_python_and_can_exceed_the_cores(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "which.py"
    script.write_text("import sys, fabric; print(sys.executable)\n")
    result = slurm_cluster.run(["srun", "-n", "4", "python", str(script)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [sys.executable] * 4


def test_a_batch_shell_is_not_a_step(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\npython -c '{PRINT_VARIABLES}' SLURM_\n")
    result = slurm_cluster.run(["sbatch", "--wait", "-n", "2", f"--output={tmp_path / 'job.out'}", str(script)])
    assert result.returncode == 0, result.stderr
    (shell,) = _printed((tmp_path / "job.out").read_text())
    assert (shell["SLURM_PROCID"], shell["SLURM_NTASKS"]) == ("0", "2")
    assert "SLURM_STEP_ID" not in shell and "SLURM_STEPID" not in shell


def test_salloc_runs_its_command_outside_any_task(slurm_cluster: SlurmCluster) -> None:
    result = slurm_cluster.run(["salloc", "-n", "2", "python", "-c", PRINT_VARIABLES, "SLURM_"])
    assert result.returncode == 0, result.stderr
    (command,) = _printed(result.stdout)
    assert (command["SLURM_JOB_NAME"], command["SLURM_NTASKS"]) == ("interactive", "2")
    assert "SLURM_PROCID" not in command and "SLURM_STEP_ID" not in command


TRAP_TERM = """
import os, pathlib, signal, sys, time
rank = os.environ["SLURM_PROCID"]
def on_term(signum, frame):
    pathlib.Path(f"term{rank}").write_text("TERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path(f"ready{rank}").write_text("")
time.sleep(120)
"""


def test_scancel_signals_every_task_of_a_running_step(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    step = slurm_cluster.popen(["srun", "-n", "2", "python", "-c", TRAP_TERM], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready{rank}").exists() for rank in range(2)):
            assert step.poll() is None and time.monotonic() < deadline, step.communicate()
            time.sleep(0.1)
        (job,) = slurm_cluster.job_ids()
        cancelled = slurm_cluster.run(["scancel", "--signal=TERM", job])
        assert cancelled.returncode == 0, cancelled.stderr
        step.wait(30)
    finally:
        stop_process(step)
    assert [(tmp_path / f"term{rank}").read_text() for rank in range(2)] == ["TERM", "TERM"]


def test_openmpi_sets_its_rank_variables(mpi_launchers: MpiLaunchers) -> None:
    command = mpi_launchers.openmpi(["python", "-c", PRINT_VARIABLES, "OMPI_COMM_WORLD_", "MASTER_"])
    result = mpi_launchers.run(command)
    assert result.returncode == 0, result.stderr
    ranks = sorted(_printed(result.stdout), key=lambda rank: rank["OMPI_COMM_WORLD_RANK"])
    names = ("RANK", "LOCAL_RANK", "NODE_RANK", "SIZE", "LOCAL_SIZE")
    assert [tuple(rank[f"OMPI_COMM_WORLD_{name}"] for name in names) for rank in ranks] == [
        ("0", "0", "0", "2", "2"),
        ("1", "1", "1", "2", "2"),
    ]
    assert {rank["MASTER_ADDR"] for rank in ranks} == {"127.0.0.1"}


def test_mpich_sets_its_rank_variables(mpi_launchers: MpiLaunchers) -> None:
    command = mpi_launchers.mpich(["python", "-c", PRINT_VARIABLES, "PMI_", "MPI_LOCAL", "MASTER_"])
    result = mpi_launchers.run(command)
    assert result.returncode == 0, result.stderr
    ranks = sorted(_printed(result.stdout), key=lambda rank: rank["PMI_RANK"])
    names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    assert [tuple(rank[name] for name in names) for rank in ranks] == [("0", "2", "0", "2"), ("1", "2", "1", "2")]
    assert {rank["MASTER_ADDR"] for rank in ranks} == {"127.0.0.1"}
