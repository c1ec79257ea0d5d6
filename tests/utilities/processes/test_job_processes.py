"""What a job's processes do when it is preempted or fails, with DataLoader workers (``num_workers=2``): a
SIGTERM to the whole process group (as SLURM and a terminal send it) lets the Trainer save and exit 75, and a job
that fails leaves no worker behind, under the in-script launch and ``fabric run``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric.trainer.checkpoint.preemption import PREEMPTED_EXIT_CODE

#: Slow: whole jobs with dataloader workers signalled and stopped (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

SCRIPTS = Path(__file__).parents[2] / "scripts"
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _command(launcher: str, tmp_path: Path, script: str, *args: str) -> list[str]:
    if launcher == "in-script":
        return [sys.executable, str(SCRIPTS / script), *args]
    run_dir = str(tmp_path / "run")
    return [sys.executable, "-m", "fabric_cli", "run", "model", "--devices", "2", "--run-dir", run_dir,
            str(SCRIPTS / script), *args]  # fmt: skip


def _start(command: list[str]) -> subprocess.Popen[str]:
    """The job in a process group of its own, as a batch system or a terminal runs it."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _kill_what_is_left(job: subprocess.Popen[str]) -> None:
    """A test that failed midway leaves nothing running: the job's whole process group is killed."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def _left_of(group: int) -> list[str]:
    """The processes of the job's process group still alive (zombies do not count)."""
    listing = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "-g", str(group)], capture_output=True, text=True)
    return [line for line in listing.stdout.splitlines() if line.split()[1][0] != "Z"]


@pytest.mark.parametrize("launcher", ["in-script", "fabric-run"])
def test_sigterm_to_the_whole_job_with_dataloader_workers_saves_and_exits_75(tmp_path: Path, launcher: str) -> None:
    """The workers died of the SIGTERM too, the next batch raised "DataLoader worker (pid N) is killed by signal:
    Terminated", and fit() died with exit 1 and no checkpoint."""
    folder = str(tmp_path / "ckpt")
    extra = ["devices=2", "strategy=ddp"] if launcher == "in-script" else []
    job = _start(_command(launcher, tmp_path, "trainer_resume.py", folder, "100000", "1000ba", "num_workers=2", *extra))
    try:
        assert job.stdout is not None
        assert job.stdout.readline().startswith("training"), job.communicate(timeout=60)  # rank 0 is in fit()
        os.killpg(job.pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        _kill_what_is_left(job)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr
    assert "killed by signal" not in stderr and "Traceback" not in stderr, stderr
    assert _left_of(job.pid) == []
    resumed = subprocess.run(
        _command(launcher, tmp_path, "trainer_resume.py", folder, "0", "1000ba", "num_workers=2", *extra),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith("resumed at batch "), resumed.stdout  # the preemption checkpoint was written


@pytest.mark.parametrize("launcher", ["in-script", "fabric-run"])
def test_a_failing_job_leaves_no_dataloader_worker_behind(tmp_path: Path, launcher: str) -> None:
    """Rank 0 was stopped while its worker was busy; the worker, re-parented to init, kept running and held the
    job's output pipe open (a caller reading it waited for the worker's whole 10 minutes)."""
    job = _start(_command(launcher, tmp_path, "busy_workers.py", str(tmp_path)))
    try:
        _, stderr = job.communicate(timeout=60)  # returns only once every holder of the pipes is gone
    finally:
        _kill_what_is_left(job)
    assert job.returncode == 3, stderr
    worker = int((tmp_path / "worker.pid").read_text())
    assert _left_of(job.pid) == [], f"worker {worker} (or another process of the job) outlived it"


@pytest.mark.parametrize("launcher", ["one-process", "in-script"])
def test_sigterm_during_a_long_evaluation_saves_at_the_next_batch(tmp_path: Path, launcher: str) -> None:
    """The Trainer used to finish the whole evaluation first (20 s here), past a scheduler's grace period: the ranks
    were SIGKILLed and no checkpoint was written."""
    ranks = 2 if launcher == "in-script" else 1
    extra = ["devices=2", "strategy=ddp"] if ranks == 2 else []
    job = _start([sys.executable, str(SCRIPTS / "trainer_long_eval.py"), str(tmp_path), *extra])
    try:
        while not (tmp_path / "evaluating").exists():
            assert job.poll() is None, job.communicate()
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        _kill_what_is_left(job)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr
    for rank in range(ranks):
        evaluated = (tmp_path / f"evaluated-rank{rank}").read_text().split()
        assert len(evaluated) < 40 // ranks, f"rank {rank} evaluated {len(evaluated)} samples: the round was not cut"
    assert [path.name for path in (tmp_path / "ckpt").glob("ep*.pt")] == ["ep0-ba1-rank0.pt"]  # saved at batch 1
