"""Every replica group of a fault-tolerant run on this machine, each supervised on its own: torchft's lighthouse
(unless the run names one), then one supervisor per group.

Two launchers use it: ``fabric run model --replica-groups=N`` without ``--replica-group`` (each group a CLI job), and
``python train.py`` whose fault-tolerant strategy has no group index (:class:`ReplicaGroupsLauncher`: each group the
script run again with its group's variables, launching its own ranks as an in-script job does).

Each supervisor is a forked child that runs one group and exits with the group's code: the first rank of a group to
fail ends that group, not the others. The parent says which group ended and how, and waits for the rest; with
``max_restarts=K`` it starts a failed group again (up to K times per group) while no group has finished and no stop
signal came: the new group joins the running ones and takes their state. SIGTERM/SIGINT go to every group. The exit
code is 0 when a group finished the run, else the first group's failure code.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from typing_extensions import override

from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.subprocess_script import script_command
from fabric.utilities.cli_contract import FT_LIGHTHOUSE, FT_REPLICA_GROUP, FT_REPLICA_GROUPS
from fabric.utilities.ports import find_free_port
from fabric.utilities.processes.rank_environment import thread_defaults
from fabric.utilities.processes.workers import die_with_parent

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: How long the lighthouse may take to listen (it imports torchft first).
LIGHTHOUSE_START_SECONDS = 60.0

#: Runs replica group ``group`` (started for the ``restart``-th time, 0 first) in a forked child; its exit code.
GroupRun = Callable[[int, int], int]


class LighthouseNotStarted(Exception):
    """The lighthouse started for the groups did not come up; no group was started."""


@dataclass(frozen=True)
class LocalReplicaGroups:
    """What to start: ``count`` groups, each run by ``run_group``, after the lighthouse on ``lighthouse_bind`` (its
    output in ``lighthouse_log``); no bind: the groups use one already running."""

    count: int
    run_group: GroupRun
    lighthouse_bind: str | None = None
    lighthouse_log: Path | None = None
    #: How many times each group that failed is started again.
    max_restarts: int = 0
    #: What the line announcing a restart adds about the new group (e.g. its run dir).
    describe_restart: Callable[[int, int], str] = lambda group, restart: ""


def run_replica_groups(groups: LocalReplicaGroups) -> int:
    """Start the lighthouse and the groups, wait for every group; the exit code of the run."""
    bind, log = groups.lighthouse_bind, groups.lighthouse_log
    assert bind is None or log is not None, "a lighthouse started here writes its log"
    lighthouse = None if bind is None or log is None else start_lighthouse(bind, log)
    supervisors: dict[int, int] = {}  # pid -> group, of the groups running
    stopping: list[int] = []  # the stop signals received: no group is restarted after one

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        for pid in list(supervisors):  # a copy: the handler may run while the dict changes
            with contextlib.suppress(ProcessLookupError):  # that group has ended already
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in _STOP_SIGNALS}
    try:
        for index in range(groups.count):
            supervisors[_fork_supervisor(groups.run_group, index, 0)] = index
        return _wait(groups, supervisors, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lighthouse is not None:
            stop_lighthouse(lighthouse)


def start_lighthouse(bind: str, log: Path) -> subprocess.Popen[bytes]:
    """torchft's lighthouse on ``bind``, once it listens (it writes its address first). Its output goes to ``log``,
    never to a pipe nobody reads, which would stall it once full in a long run."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as output:
        process = subprocess.Popen(  # it serves until its standard input, this pipe, closes
            [sys.executable, "-m", "fabric.strategies.fault_tolerant.lighthouse", bind],
            stdin=subprocess.PIPE,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + LIGHTHOUSE_START_SECONDS
    while f"{FT_LIGHTHOUSE}=".encode() not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_lighthouse(process, grace=1.0)
            lines = log.read_text(errors="replace").strip().splitlines()
            raise LighthouseNotStarted(f"the lighthouse on {bind} did not start: {lines[-1] if lines else 'no output'}")
        time.sleep(0.05)
    print(f"fabric: torchft lighthouse on {bind} for the replica groups (log: {log})", file=sys.stderr, flush=True)
    return process


def stop_lighthouse(lighthouse: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """End a lighthouse :func:`start_lighthouse` started (it ignores SIGTERM): close its input, then kill it if it has
    not ended within ``grace`` seconds."""
    assert lighthouse.stdin is not None
    with contextlib.suppress(OSError):  # it has ended already
        lighthouse.stdin.close()
    try:
        lighthouse.wait(grace)
    except subprocess.TimeoutExpired:
        lighthouse.kill()
        lighthouse.wait()


def _fork_supervisor(run_group: GroupRun, group: int, restart: int) -> int:
    """A child of this process that runs one group and exits with the group's code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)  # the group's run installs its own
        code = run_group(group, restart)
    except BaseException:  # the group's supervisor failed: said here, since the parent's handlers are not the child's
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(groups: LocalReplicaGroups, supervisors: dict[int, int], stopping: list[int]) -> int:
    """Wait until every group has ended, restarting failed ones while that can help; the run's exit code."""
    codes: list[int] = []
    restarts = dict.fromkeys(range(groups.count), 0)
    running = len(supervisors)
    while running:
        pid, status = os.waitpid(-1, 0)
        if pid not in supervisors:
            continue
        running -= 1
        group = supervisors.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        code = code if code >= 0 else 128 - code  # a supervisor killed by a signal: the shell's convention
        codes.append(code)
        if code == 0:
            continue
        if restarts[group] < groups.max_restarts and not stopping and 0 not in codes:
            restarts[group] += 1
            supervisors[_fork_supervisor(groups.run_group, group, restarts[group])] = group
            running += 1
            ending = (
                f"; restarting it ({restarts[group]} of {groups.max_restarts})"
                f"{groups.describe_restart(group, restarts[group])}."
            )
        else:
            going_on = running and not stopping  # after a stop signal the others are ending too
            ending = f"; {running} other group{'s go' if running != 1 else ' goes'} on." if going_on else "."
        print(f"fabric: replica group {group} ended with exit code {code}{ending}", file=sys.stderr, flush=True)
    return 0 if 0 in codes else codes[0]


class ReplicaGroupsLauncher(Launcher):
    """``python train.py`` with a fault-tolerant strategy given the number of groups but not this process's group:
    this process starts the lighthouse (unless ``lighthouse`` names one) and every group on this machine, as
    ``fabric run model --replica-groups=N`` does, and ends with the run's exit code; it trains in none of them.

    Each group is the script run again with the group's variables and a rendezvous port of its own; it starts its
    ``num_processes`` ranks as any in-script job does.
    """

    def __init__(self, replica_groups: int, lighthouse: str | None, num_processes: int) -> None:
        self.replica_groups = replica_groups
        self.lighthouse = lighthouse
        self.num_processes = num_processes

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> NoReturn:
        if self.lighthouse is not None:
            sys.exit(run_replica_groups(LocalReplicaGroups(self.replica_groups, self._group_run(self.lighthouse))))
        bind = f"127.0.0.1:{find_free_port()}"
        logs = Path(tempfile.mkdtemp(prefix="fabric-replica-groups-"))
        code = run_replica_groups(
            LocalReplicaGroups(self.replica_groups, self._group_run(f"http://{bind}"), bind, logs / "lighthouse.log")
        )
        if code == 0:  # the lighthouse's log is kept where something failed
            shutil.rmtree(logs, ignore_errors=True)
        sys.exit(code)

    def _group_run(self, lighthouse: str) -> GroupRun:
        return partial(self._run_group, lighthouse=lighthouse)

    def _run_group(self, group: int, restart: int, lighthouse: str) -> NoReturn:
        """Become replica group ``group``'s first process: the script again, with the group's variables."""
        die_with_parent()  # kept across the exec: the groups end with this process
        environment = {
            **os.environ,
            **thread_defaults(self.replica_groups * self.num_processes),  # the machine's cores shared by all groups
            FT_REPLICA_GROUP: str(group),
            FT_REPLICA_GROUPS: str(self.replica_groups),
            FT_LIGHTHOUSE: lighthouse,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port()),
        }
        command = script_command()
        os.execve(command[0], command, environment)
