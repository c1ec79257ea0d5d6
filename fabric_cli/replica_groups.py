"""Every replica group of a fault-tolerant run on this machine (``fabric run model --replica-groups=N`` without
``--replica-group``): torchft's lighthouse (``fabric lighthouse``, unless ``--lighthouse`` names one), then one
supervisor per group.

Each supervisor is a forked copy of this CLI that runs its group exactly as ``--replica-group=I`` would
(:func:`fabric_cli.runner.run`): the first rank of a group to fail ends that group, not the others. The CLI says which
group ended and how, and waits for the rest; with ``--max-restarts=K`` it starts a failed group again (up to K times
per group, in a run dir ``groupI-restartN`` and on a fresh rendezvous port) while no group has finished and no stop
signal came: the new group joins the running ones and takes their state. SIGTERM/SIGINT go to every group (each then
stops its ranks as a one-group job does). The CLI exits 0 when a group finished the run, else with the first group's
failure code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import FrameType

from fabric.utilities.cli_contract import FT_LIGHTHOUSE
from fabric.utilities.ports import find_free_port
from fabric.utilities.processes.supervision import stop_processes
from fabric.utilities.processes.workers import die_with_parent
from fabric_cli.plan import GroupsPlan, LaunchPlan
from fabric_cli.runner import run

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: How long the lighthouse may take to listen (it imports torchft first).
LIGHTHOUSE_START_SECONDS = 60.0


class LighthouseError(Exception):
    """The lighthouse the CLI starts for the groups did not come up; no group was started."""


def run_groups(plan: GroupsPlan) -> int:
    """Start the lighthouse and the groups, wait for every group; the exit code the CLI ends with."""
    bind = plan.lighthouse_bind
    lighthouse = None if bind is None else _start_lighthouse(bind, plan.run_dir / "lighthouse.log")
    supervisors: dict[int, int] = {}  # pid -> group, of the groups running
    stopping: list[int] = []  # the stop signals received: no group is restarted after one

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        for pid in list(supervisors):  # a copy: the handler may run while the dict changes
            with contextlib.suppress(ProcessLookupError):  # that group has ended already
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in _STOP_SIGNALS}
    try:
        for index, group in enumerate(plan.groups):
            supervisors[_fork_supervisor(group)] = index
        return _wait(plan, supervisors, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lighthouse is not None:
            stop_processes([lighthouse], grace=5.0)


def _start_lighthouse(bind: str, log: Path) -> subprocess.Popen[bytes]:
    """``fabric lighthouse --bind=BIND``, once it listens (it writes its address first). Its output goes to ``log``,
    never to a pipe nobody reads, which would stall it once full in a long run."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "fabric_cli", "lighthouse", f"--bind={bind}"],
            stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    deadline = time.monotonic() + LIGHTHOUSE_START_SECONDS
    while f"{FT_LIGHTHOUSE}=".encode() not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_processes([process], grace=1.0)
            lines = log.read_text(errors="replace").strip().splitlines()
            raise LighthouseError(f"the lighthouse on {bind} did not start: {lines[-1] if lines else 'no output'}")
        time.sleep(0.05)
    print(f"fabric: torchft lighthouse on {bind} for the replica groups (log: {log})", file=sys.stderr, flush=True)
    return process


def _fork_supervisor(group: LaunchPlan) -> int:
    """A child of this CLI that runs one group's plan and exits with the group's code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)  # runner.run installs its own
        code = run(group)
    except BaseException:  # the group's supervisor failed: said here, since the CLI's own handlers are the parent's
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(plan: GroupsPlan, supervisors: dict[int, int], stopping: list[int]) -> int:
    """Wait until every group has ended, restarting failed ones while that can help; the CLI's exit code."""
    codes: list[int] = []
    restarts = dict.fromkeys(range(len(plan.groups)), 0)
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
        if restarts[group] < plan.max_restarts and not stopping and 0 not in codes:
            restarts[group] += 1
            restart = _restarted(plan.groups[group], restarts[group])
            supervisors[_fork_supervisor(restart)] = group
            running += 1
            ending = f"; restarting it ({restarts[group]} of {plan.max_restarts}), run dir {restart.run_dir}."
        else:
            ending = f"; {running} other group{'s go' if running != 1 else ' goes'} on." if running else "."
        print(f"fabric: replica group {group} ended with exit code {code}{ending}", file=sys.stderr, flush=True)
    return 0 if 0 in codes else codes[0]


def _restarted(group: LaunchPlan, restart: int) -> LaunchPlan:
    """The group started again: its own run dir, and a fresh rendezvous port (the old store's may linger)."""
    return dataclasses.replace(
        group, run_dir=group.run_dir.with_name(f"{group.run_dir.name}-restart{restart}"), main_port=find_free_port()
    )
