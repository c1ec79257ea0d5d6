"""Start a plan's processes and supervise them until the job ends, as one program would.

- Local rank 0 keeps the terminal; the other ranks write ``stdout.log``/``stderr.log`` in the run dir.
- The first rank to exit non-zero ends the job: the others get SIGTERM (then SIGKILL), and the CLI
  exits with that rank's own code after one line naming it, plus the tail of its stderr log.
- SIGINT / SIGTERM to the CLI stop every rank the same way; the CLI then exits 130 / 143.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import FrameType
from typing import IO

from fabric.strategies.launchers.processes import describe_exit, die_with_parent, exit_code, stop_processes
from fabric_cli.plan import LaunchPlan

STDERR_TAIL_LINES = 20


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def run(plan: LaunchPlan) -> int:
    """Run the job; return the exit code the CLI should end with."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    processes: dict[int, subprocess.Popen[bytes]] = {}
    log_files: list[IO[bytes]] = []
    try:
        for local_rank in range(plan.processes):
            processes[local_rank] = _start(plan, local_rank, log_files)
        return _supervise(plan, processes)
    except _Stopped as stopped:
        stop_processes(processes.values())
        return 128 + stopped.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for file in log_files:
            file.close()


def _start(plan: LaunchPlan, local_rank: int, log_files: list[IO[bytes]]) -> subprocess.Popen[bytes]:
    environment = {**os.environ, **plan.rank_environment(local_rank)}
    if local_rank == 0:
        return subprocess.Popen(plan.command(), env=environment, preexec_fn=die_with_parent)
    stdout_path, stderr_path = plan.log_files(local_rank)
    stdout_path.parent.mkdir(parents=True, exist_ok=True)
    stdout, stderr = open(stdout_path, "wb"), open(stderr_path, "wb")  # noqa: SIM115 - closed by run()
    log_files += [stdout, stderr]
    return subprocess.Popen(plan.command(), env=environment, stdout=stdout, stderr=stderr, preexec_fn=die_with_parent)


def _supervise(plan: LaunchPlan, processes: dict[int, subprocess.Popen[bytes]]) -> int:
    by_pid = {process.pid: local_rank for local_rank, process in processes.items()}
    while by_pid:
        pid, status = os.wait()
        local_rank = by_pid.pop(pid, None)
        if local_rank is None:
            continue
        returncode = os.waitstatus_to_exitcode(status)
        processes[local_rank].returncode = returncode  # we reaped it; tell Popen
        if returncode != 0:
            _report_failure(plan, local_rank, returncode)
            stop_processes(processes.values())
            return exit_code(returncode)
    return 0


def _report_failure(plan: LaunchPlan, local_rank: int, returncode: int) -> None:
    rank = plan.global_rank(local_rank)
    if local_rank == 0:
        print(
            f"fabric: rank {rank} exited with code {describe_exit(returncode)} (its output is above).", file=sys.stderr
        )
        return
    stderr_path = plan.log_files(local_rank)[1]
    print(f"fabric: rank {rank} exited with code {describe_exit(returncode)}; log: {stderr_path}", file=sys.stderr)
    for line in _tail(stderr_path, STDERR_TAIL_LINES):
        print(f"  [rank {rank}] {line}", file=sys.stderr)


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as file:
            return [line.rstrip("\n") for line in deque(file, maxlen=lines)]
    except OSError:
        return []
