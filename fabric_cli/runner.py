"""Start a plan's processes and supervise them until the job ends, as one program would.

- Several nodes first check in with node 0 (:mod:`fabric_cli.join`); then each starts its ranks.
- Local rank 0 keeps the terminal; the other ranks write to log files (the run dir, or the
  ``--stdout``/``--stderr`` templates).
- The first rank to exit non-zero ends the job: the others get SIGTERM (then SIGKILL), and the CLI
  exits with that rank's own code after one line naming it, plus the tail of its stderr log.
- SIGTERM to the CLI (a scheduler preempting the job) is forwarded to every rank, which then get
  ``--term-timeout`` seconds to exit (the Trainer saves a checkpoint and exits 75); the CLI exits with
  the ranks' code, or 143 if it had to SIGKILL one. SIGINT stops the ranks the same way and exits 130.
  A second signal while waiting kills the ranks at once.

Every exit code above comes from the one table of :mod:`fabric.utilities.exit_codes`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import IO

from fabric.utilities.exit_codes import RankExit, failure_cause, job_exit_code
from fabric.utilities.peer_loss import CAUSE_GRACE_SECONDS, lost_peer_marker
from fabric.utilities.processes.supervision import describe_exit, exits_in_order, oom_kill_count, stop_processes
from fabric.utilities.processes.workers import die_with_parent
from fabric_cli.join import join
from fabric_cli.plan import LaunchPlan

STDERR_TAIL_LINES = 20
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def run(plan: LaunchPlan) -> int:
    """Run the job; return the exit code the CLI should end with."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in _STOP_SIGNALS}
    processes: dict[int, subprocess.Popen[bytes]] = {}
    log_files: list[IO[bytes]] = []
    try:
        try:
            outputs = _open_outputs(plan, log_files)  # before anything starts: a path that cannot be written stops it
            layout = join(plan.layout, plan.main_address, plan.main_port, plan.join_timeout)
            plan = dataclasses.replace(plan, layout=layout)  # the node count and node rank, if they were open
            _say(plan, _start_line(plan))
            oom_kills_before = oom_kill_count()  # tells a SIGKILL by the OOM killer from others
            for local_rank in range(plan.processes):
                processes[local_rank] = _start(plan, local_rank, outputs.get(local_rank))
            return _supervise(plan, processes, oom_kills_before)
        except _Stopped as stopped:
            return _stop_on_signal(plan, processes, stopped.signum)
    except _Stopped as again:  # a second signal while the ranks were given time to exit
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        return job_exit_code(_exits(processes), stop_signal=again.signum, killed=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for file in log_files:
            file.close()


def _start_line(plan: LaunchPlan) -> str:
    layout = plan.layout
    return (
        f"node {layout.node_rank} of {layout.num_nodes} starts ranks {layout.ranks[0]}..{layout.ranks[-1]} "
        f"of {layout.world_size} (rendezvous {plan.main_address}:{plan.main_port}): {' '.join(plan.command())}"
    )


def _say(plan: LaunchPlan, message: str) -> None:
    if plan.verbose:
        print(f"fabric: {message}", file=sys.stderr, flush=True)


class OutputError(Exception):
    """The run directory or a rank's log file cannot be written; nothing was started."""


_Outputs = tuple[IO[bytes], IO[bytes]]


def _open_outputs(plan: LaunchPlan, log_files: list[IO[bytes]]) -> dict[int, _Outputs]:
    """The run directory and every rank's log files (stdout, stderr), opened before any rank starts."""
    _make_directory(plan.run_dir, "the run directory (--run-dir)")
    outputs = {}
    for local_rank in range(1, plan.processes):
        stdout_path, stderr_path = plan.log_files(local_rank)
        stdout = _open_log(stdout_path, log_files, f"rank {plan.global_rank(local_rank)}'s stdout (--stdout)")
        stderr = (
            stdout
            if stderr_path == stdout_path
            else _open_log(stderr_path, log_files, f"rank {plan.global_rank(local_rank)}'s stderr (--stderr)")
        )
        outputs[local_rank] = (stdout, stderr)
    return outputs


def _make_directory(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"cannot create {what} {str(path)!r}: {error.strerror or error}") from None


def _open_log(path: Path, log_files: list[IO[bytes]], what: str) -> IO[bytes]:
    _make_directory(path.parent, f"the folder of {what}")
    try:
        file = open(path, "wb")  # noqa: SIM115 - closed by run()
    except OSError as error:
        raise OutputError(f"cannot write {what} {str(path)!r}: {error.strerror or error}") from None
    log_files.append(file)
    return file


def _start(plan: LaunchPlan, local_rank: int, outputs: _Outputs | None) -> subprocess.Popen[bytes]:
    environment = {**os.environ, **plan.rank_environment(local_rank)}
    if outputs is None:  # local rank 0 keeps the terminal
        return subprocess.Popen(plan.command(), env=environment, preexec_fn=die_with_parent)
    stdout_path, stderr_path = plan.log_files(local_rank)
    _say(plan, f"rank {plan.global_rank(local_rank)} writes stdout to {stdout_path}, stderr to {stderr_path}")
    stdout, stderr = outputs
    return subprocess.Popen(plan.command(), env=environment, stdout=stdout, stderr=stderr, preexec_fn=die_with_parent)


def _supervise(plan: LaunchPlan, processes: dict[int, subprocess.Popen[bytes]], oom_kills_before: int | None) -> int:
    ended = []
    for local_rank, returncode in exits_in_order(processes):
        ended.append(RankExit(local_rank, returncode))
        if ended[-1].failed:
            exits = _exits_once_the_cause_shows(plan, processes, local_rank)
            cause = failure_cause(exits)
            assert cause is not None, "the exits hold the failed rank's"
            stop_processes(processes.values())  # first, so that the summary is the last thing on screen
            _report_failure(plan, cause.rank, describe_exit(cause.returncode, oom_kills_before))
            if cause.rank != local_rank:
                print(f"fabric: rank {plan.global_rank(local_rank)} failed after it.", file=sys.stderr)
            return job_exit_code(exits)
        _say(plan, f"rank {plan.global_rank(local_rank)} exited with code {describe_exit(returncode)}")
    return job_exit_code(ended)


def _exits_once_the_cause_shows(
    plan: LaunchPlan, processes: dict[int, subprocess.Popen[bytes]], first_failed: int
) -> list[RankExit]:
    """The exits of the ranks that have ended, ``first_failed`` first, each marked if it failed only because another
    rank's process ended (it left its lost-peer marker). Such a rank can notice before that process has finished
    exiting: while every failure is of that kind, this waits up to :data:`CAUSE_GRACE_SECONDS` for a rank that
    failed by itself, the cause."""
    deadline = time.monotonic() + CAUSE_GRACE_SECONDS
    order = [first_failed, *(local_rank for local_rank in processes if local_rank != first_failed)]
    while True:
        exits = [
            RankExit(local_rank, code, lost_a_peer=_lost_a_peer(plan, local_rank))
            for local_rank in order
            if (code := processes[local_rank].returncode) is not None  # set by its waiter thread once it has ended
        ]
        cause = failure_cause(exits)
        if cause is None or not cause.lost_a_peer or time.monotonic() >= deadline:
            return exits
        time.sleep(0.05)


def _lost_a_peer(plan: LaunchPlan, local_rank: int) -> bool:
    return lost_peer_marker(plan.run_dir, plan.global_rank(local_rank)).exists()


def _stop_on_signal(plan: LaunchPlan, processes: dict[int, subprocess.Popen[bytes]], signum: int) -> int:
    """Forward SIGTERM to the ranks, give them ``plan.term_timeout`` seconds, and pick the CLI's exit code."""
    running = {local_rank: process for local_rank, process in processes.items() if process.poll() is None}
    print(
        f"fabric: {signal.Signals(signum).name} received: sent SIGTERM to {len(running)} rank(s), which get "
        f"{plan.term_timeout:g} s to exit (--term-timeout).",
        file=sys.stderr,
        flush=True,
    )
    for process in running.values():
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + plan.term_timeout
    killed = False
    for local_rank, process in running.items():
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            killed = True
            print(
                f"fabric: rank {plan.global_rank(local_rank)} did not exit within {plan.term_timeout:g} s of SIGTERM "
                "(--term-timeout); killed it.",
                file=sys.stderr,
                flush=True,
            )
    return job_exit_code(_exits(processes), stop_signal=signum, killed=killed)


def _exits(processes: dict[int, subprocess.Popen[bytes]]) -> list[RankExit]:
    """The exits of the ranks that have ended."""
    return [
        RankExit(local_rank, process.returncode)
        for local_rank, process in processes.items()
        if process.returncode is not None
    ]


def _report_failure(plan: LaunchPlan, local_rank: int, description: str) -> None:
    rank = plan.global_rank(local_rank)
    if local_rank == 0:
        print(f"fabric: rank {rank} exited with code {description} (its output is above).", file=sys.stderr)
        return
    stderr_path = plan.log_files(local_rank)[1]
    print(f"fabric: rank {rank} exited with code {description}; log: {stderr_path}", file=sys.stderr)
    for line in _tail(stderr_path, STDERR_TAIL_LINES):
        print(f"  [rank {rank}] {line}", file=sys.stderr)


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as file:
            return [line.rstrip("\n") for line in deque(file, maxlen=lines)]
    except OSError:
        return []
