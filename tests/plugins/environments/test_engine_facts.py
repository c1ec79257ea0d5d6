"""What the real engines do that Fabric's detection relies on (so a new SLURM that changes it fails here first):
an ``sbatch`` script's shell and a command under ``salloc`` are not job steps, though they see ``SLURM_NTASKS``;
``srun`` tasks run this interpreter, more of them than there are cores. How Fabric behaves under each engine is
tested beside this file (``test_engines_slurm.py``, ``test_engines_mpi.py``) and in
``tests/strategies/launchers/test_launched_worlds.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import engines
from engines import SlurmCluster

slurm_cluster = engines.slurm_cluster  # the fixture this module uses

#: Prints the task's variables whose names start with one of its arguments, as one JSON line.
PRINT_VARIABLES = """
import json, os, sys
prefixes = tuple(sys.argv[1:])
print(json.dumps({k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}), flush=True)
"""


def _printed(stdout: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_srun_tasks_get_this_python_and_can_exceed_the_cores(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "which.py"
    script.write_text("import sys, fabric; print(sys.executable)\n")
    result = slurm_cluster.run(["srun", "-n", "4", "python", str(script)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [sys.executable] * 4


def test_a_batch_shell_is_not_a_step(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\npython -c '{PRINT_VARIABLES}' SLURM_\n")
    assert slurm_cluster.batch(["-n", "2", f"--output={tmp_path / 'job.out'}", str(script)]) == 0
    (shell,) = _printed((tmp_path / "job.out").read_text())
    assert (shell["SLURM_PROCID"], shell["SLURM_NTASKS"]) == ("0", "2")
    assert "SLURM_STEP_ID" not in shell and "SLURM_STEPID" not in shell


def test_a_batch_job_ends_with_its_scripts_exit_code(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """What the tests' batch jobs report (SlurmCluster.batch): the script's code, a signal as 128 + its number."""
    script = tmp_path / "fails.sh"
    script.write_text("#!/bin/bash\nexit 3\n")
    assert slurm_cluster.batch([f"--output={tmp_path / 'fails.out'}", str(script)]) == 3
    script.write_text("#!/bin/bash\nkill -TERM $$\n")
    assert slurm_cluster.batch([f"--output={tmp_path / 'killed.out'}", str(script)]) == 128 + 15


def test_salloc_runs_its_command_outside_any_task(slurm_cluster: SlurmCluster) -> None:
    result = slurm_cluster.run(["salloc", "-n", "2", "python", "-c", PRINT_VARIABLES, "SLURM_"])
    assert result.returncode == 0, result.stderr
    (command,) = _printed(result.stdout)
    assert (command["SLURM_JOB_NAME"], command["SLURM_NTASKS"]) == ("interactive", "2")
    assert "SLURM_PROCID" not in command and "SLURM_STEP_ID" not in command
