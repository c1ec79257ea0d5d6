"""``fabric run model --replica-groups=N`` without ``--replica-group``: every group supervised on its own, a failed
group restarted up to ``--max-restarts`` times while the run goes on, and the exit code the command ends with.

The scripts here only read the group variables the command sets (no torchft): what is tested is the command's
supervision. The fault-tolerant training itself, started this way, is tested in
``tests/strategies/fault_tolerant/test_fault_tolerant.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fabric.utilities.cli_contract import FT_REPLICA_GROUP
from tests.engines import launcher_environment

#: Group 1 fails with code 3 the first time; group 0 ends once group 1 has run again (or at once when told to fail).
SCRIPT = f"""
import os, sys, time
from pathlib import Path
folder, group = Path(sys.argv[1]), os.environ["{FT_REPLICA_GROUP}"]
starts = folder / f"starts{{group}}"
starts.write_text(starts.read_text() + "x" if starts.exists() else "x")
if sys.argv[2] == "all-fail":
    sys.exit(3)
if group == "1" and starts.read_text() == "x":
    sys.exit(3)
if group == "0":
    deadline = time.monotonic() + 60
    while not (folder / "starts1").exists() or (folder / "starts1").read_text() != "xx":
        if time.monotonic() > deadline:
            sys.exit(4)
        time.sleep(0.05)
"""


def _run_groups(tmp_path: Path, mode: str, *options: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "group.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "fabric_cli", "run", "model", "--accelerator=cpu", "--devices=1"]
    command += ["--replica-groups=2", "--lighthouse=127.0.0.1:9", f"--run-dir={tmp_path / 'run'}", *options]
    return subprocess.run(
        [*command, str(script), "--", str(tmp_path), mode],
        env=launcher_environment(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_failed_group_is_restarted_and_the_run_ends_well(tmp_path: Path) -> None:
    result = _run_groups(tmp_path, "group-1-fails-once", "--max-restarts=1")
    assert result.returncode == 0, result.stderr
    restart = tmp_path / "run" / "group1-restart1"
    line = f"fabric: replica group 1 ended with exit code 3; restarting it (1 of 1), run dir {restart}."
    assert line in result.stderr.splitlines()
    assert [(tmp_path / f"starts{group}").read_text() for group in (0, 1)] == ["x", "xx"]


def test_groups_that_fail_past_their_restarts_end_the_command_with_their_code(tmp_path: Path) -> None:
    result = _run_groups(tmp_path, "all-fail")
    assert result.returncode == 3
    lines = [line for line in result.stderr.splitlines() if line.startswith("fabric: replica group ")]
    endings = [line.split("ended with exit code 3", 1)[1] for line in lines]
    assert endings == ["; 1 other group goes on.", "."], result.stderr  # no restart without --max-restarts
    assert sorted(line.split()[3] for line in lines) == ["0", "1"]
    assert not os.path.exists(tmp_path / "run" / "group0-restart1")


def test_a_lighthouse_that_cannot_start_stops_the_command_before_any_group(tmp_path: Path) -> None:
    broken = tmp_path / "site" / "torchft"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torchft cannot be imported')\n")
    script = tmp_path / "group.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    command = [sys.executable, "-m", "fabric_cli", "run", "model", "--accelerator=cpu", "--devices=1"]
    result = subprocess.run(
        [*command, "--replica-groups=2", f"--run-dir={tmp_path / 'run'}", str(script)],
        env=launcher_environment(
            {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("fabric: error: the lighthouse on 127.0.0.1:"), result.stderr
    assert last.endswith("did not start: fabric: error: Fault tolerance needs the torchft package: pip install torchft "
                         '(or, from a checkout of this project, pip install -e ".[ft]").'), result.stderr  # fmt: skip
    assert not (tmp_path / "started").exists()  # no group was started
