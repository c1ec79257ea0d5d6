"""SIGTERM to ``fabric run model`` reaches the ranks: the Trainer saves and the job exits 75; a rank that
ignores it is killed after ``--term-timeout``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fabric.trainer.checkpoint.preemption import PREEMPTED_EXIT_CODE

SCRIPTS = Path(__file__).parents[1] / "scripts"
FABRIC = [sys.executable, "-m", "fabric_cli", "run", "model"]


def _env() -> dict[str, str]:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {key: value for key, value in os.environ.items() if key not in launcher}


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(  # in a new temporary directory, where the job's runs/ folder goes
        [*FABRIC, *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tempfile.mkdtemp(prefix="fabric-cli-"),
    )


def test_sigterm_to_the_cli_lets_the_trainer_save_and_the_job_exits_75(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    run_dir = str(tmp_path / "run")
    job = _start(
        "--devices", "2", "--run-dir", run_dir, str(SCRIPTS / "trainer_resume.py"), folder, "100000", "10000ba"
    )
    assert job.stdout is not None
    assert job.stdout.readline().startswith("training"), job.communicate(timeout=60)  # rank 0 is in fit()
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr
    assert "SIGTERM received: sent SIGTERM to 2 rank(s), which get 30 s to exit (--term-timeout)" in stderr
    resumed = subprocess.run(
        [*FABRIC, "--devices", "2", "--run-dir", run_dir, str(SCRIPTS / "trainer_resume.py"), folder, "0"],
        env=_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith("resumed at batch "), resumed.stdout  # the preemption checkpoint was written
    assert int(resumed.stdout.split()[3]) >= 1


def test_a_rank_that_ignores_sigterm_is_killed_after_the_term_timeout(tmp_path: Path) -> None:
    job = _start(
        "--devices", "2", "--term-timeout", "0.5", "--run-dir", str(tmp_path / "run"),
        str(SCRIPTS / "cli_report.py"), str(tmp_path), "--hang", "--ignore-term",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for both ranks to come up
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM
    assert "rank 0 did not exit within 0.5 s of SIGTERM (--term-timeout); killed it." in stderr
    assert "rank 1 did not exit within 0.5 s of SIGTERM" in stderr
