"""``strategy="ddp"``: start ranks 1..N-1 by re-running the user's own command, rank 0 stays in this process.

This is what ``python train.py`` with ``Fabric(devices=N).launch()`` does. The children get the rank
variables (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ...) so their ``Fabric()`` joins instead of
launching again. A supervisor in rank 0 makes the job behave as one program:

- if a child exits non-zero, the other children are stopped (SIGTERM, then SIGKILL after a grace
  period) and rank 0 exits with that child's code, after one line naming the rank;
- if rank 0 raises, the children are stopped the same way; if it leaves with ``sys.exit(N)``, N != 0, the
  children are stopped and the job ends with N;
- if rank 0 fails only because a child's process ended (its collective lost the connection), the child is the
  cause: the job reports it and ends with its code;
- a child whose parent dies is killed by the kernel (``PR_SET_PDEATHSIG`` on Linux), never orphaned;
- at a normal end, rank 0 waits for the children and fails if any of them failed.

The job's code in each case comes from the one table of :mod:`fabric.utilities.exit_codes`. To hear rank 0's
``sys.exit(N)`` the supervisor replaces ``sys.exit`` while it watches: one replacement per process however many
supervisors there are, and the function it replaced is back once the last supervisor has seen rank 0 out.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from typing_extensions import override

from fabric.plugins.environments.cluster_environment import ClusterEnvironment
from fabric.strategies.launchers.launcher import Launcher
from fabric.utilities.exit_codes import RankExit, failure_cause, job_exit_code
from fabric.utilities.peer_loss import CAUSE_GRACE_SECONDS, a_peer_left
from fabric.utilities.processes.exit import exit_process
from fabric.utilities.processes.rank_environment import rank_variables, thread_defaults
from fabric.utilities.processes.supervision import describe_exit, exits_in_order, oom_kill_count, stop_processes
from fabric.utilities.processes.workers import die_with_parent


class SubprocessScriptLauncher(Launcher):
    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int) -> None:
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self._supervisor: ChildSupervisor | None = None

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:
            oom_kills_before = oom_kill_count()
            self._supervisor = ChildSupervisor(self._start_children(), oom_kills_before)
        return function(*args, **kwargs)

    def _start_children(self) -> dict[int, subprocess.Popen[bytes]]:
        environment = self.cluster_environment
        node_rank = environment.node_rank()
        shared = {**os.environ, **thread_defaults(self.num_processes)}
        command = script_command()
        children = {}
        for local_rank in range(1, self.num_processes):
            child_env = shared | rank_variables(
                main_address=environment.main_address,
                main_port=environment.main_port,
                node_rank=node_rank,
                world_size=self.num_processes * self.num_nodes,
                local_world_size=self.num_processes,
                local_rank=local_rank,
                global_rank=node_rank * self.num_processes + local_rank,
            )
            children[local_rank] = subprocess.Popen(command, env=child_env, preexec_fn=die_with_parent)
        return children


def script_command() -> list[str]:
    """The command line this interpreter was started with (flags, ``-m module`` and arguments included)."""
    return [sys.executable, *sys.orig_argv[1:]]


class ChildSupervisor:
    """Watches the child ranks from rank 0 and turns any failure into the failure of the whole job."""

    def __init__(self, children: dict[int, subprocess.Popen[bytes]], oom_kills_before: int | None = None) -> None:
        self.children = children
        self._oom_kills_before = oom_kills_before  # tells a SIGKILL by the OOM killer from others
        self._lock = threading.Lock()
        self._stopping = False
        self._rank_zero_exit_code: int | None = None
        RANK_ZERO_EXIT.listen(self._note_rank_zero_exit)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="fabric-child-supervisor")
        self._watcher.start()
        atexit.register(self._at_rank_zero_exit)

    def _watch(self) -> None:
        failed = next((child for child in self._child_exits() if child.failed), None)
        if failed is None:
            return
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        rank_zero = None if threading.main_thread().is_alive() else self._rank_zero_exit()
        exits = [failed] if rank_zero is None else [rank_zero, failed]
        child = f"local rank {failed.rank} (pid {self.children[failed.rank].pid})"
        if rank_zero is not None and failure_cause(exits) is rank_zero:  # rank 0 left first: why this rank failed
            self._report(f"rank 0 exited with code {rank_zero.returncode}; {child} failed after it")
        elif rank_zero is not None and rank_zero.failed:
            # Rank 0's error (printed before its main thread ended) says it only lost this rank: this rank is the cause.
            self._report(f"{child} exited with code {self._describe(failed)}; rank 0 failed after it")
        else:
            # Rank 0 still runs, or its interpreter is shutting down (its script ended, or raised SystemExit itself,
            # whose code exit handlers cannot see) and left this rank waiting for it.
            after_rank_zero = "" if rank_zero is None else " after rank 0 had ended and left it"
            self._report(f"{child} exited with code {self._describe(failed)}{after_rank_zero}")
        self.stop_children()
        exit_process(job_exit_code(exits))

    def _child_exits(self) -> Iterator[RankExit]:
        for local_rank, returncode in exits_in_order(self.children):
            yield RankExit(local_rank, returncode)

    def _rank_zero_exit(self) -> RankExit:
        """Rank 0's exit once its main thread has ended: the code it gave ``sys.exit``, else 1 after an uncaught
        error (Python's code), else 0 (its script ended, or it raised ``SystemExit`` itself, which no exit handler
        can read)."""
        error = getattr(sys, "last_value", None)
        code = self._rank_zero_exit_code or int(error is not None)
        return RankExit(0, code, lost_a_peer=a_peer_left(error), is_launcher=True)

    def _describe(self, child: RankExit) -> str:
        return describe_exit(child.returncode, self._oom_kills_before)

    @staticmethod
    def _report(what: str) -> None:
        """One line on the process's stderr, written straight to the file descriptor: the watcher reports while rank
        0's main thread may be printing its own traceback, and two threads writing through ``sys.stderr`` at once
        lost both (1 job in 15 under load)."""
        os.write(2, f"fabric: {what}; stopping the job.\n".encode())

    def _note_rank_zero_exit(self, code: int) -> None:
        self._rank_zero_exit_code = code

    def stop_children(self) -> None:
        stop_processes(self.children.values())

    def _at_rank_zero_exit(self) -> None:
        """Rank 0's process is ending: see the job to its end, then give ``sys.exit`` back."""
        try:
            self._end_the_job()
        finally:
            self.close()

    def _end_the_job(self) -> None:
        rank_zero = self._rank_zero_exit()
        if not rank_zero.failed:  # rank 0 ended well: wait for the others
            # Returns once every child has ended without failing; a child failing ends the process there.
            self._watcher.join()
            return
        if rank_zero.lost_a_peer:
            # Rank 0 failed because another rank's process ended, which it sees before that process has finished
            # exiting: give the watcher time to see that rank's exit, the cause, and end the job with its code.
            self._watcher.join(timeout=CAUSE_GRACE_SECONDS)
        with self._lock:
            child_failed_first, self._stopping = self._stopping, True
        if child_failed_first:
            self._watcher.join()  # its watcher reports it and ends the process
            return
        # Rank 0 raised, or left with sys.exit(N != 0): the job has failed, with rank 0's code, which the interpreter
        # ends the process with. The others are stopped now rather than left waiting for rank 0 in a collective (a
        # DDP model keeps rank 0's connections open until its process ends, so they would wait out the collective
        # timeout).
        if self._rank_zero_exit_code:
            self._report(f"rank 0 exited with code {self._rank_zero_exit_code}")
        self.stop_children()

    def close(self) -> None:
        """Stop hearing rank 0's ``sys.exit`` (the last supervisor to close gives it back) and its exit."""
        RANK_ZERO_EXIT.stop_listening(self._note_rank_zero_exit)
        atexit.unregister(self._at_rank_zero_exit)


class RankZeroExitHook:
    """What ``sys.exit`` is while a supervisor watches: in the main thread, it raises a ``SystemExit`` that tells,
    when it is freed, whether it ended the program (then its code is rank 0's exit code, which every listening
    supervisor hears) or was caught; elsewhere, it exits as the replaced ``sys.exit`` does.

    Exit handlers cannot see a process's exit status, so this is how the job learns that rank 0 is leaving with an
    error while other ranks still run (and may be waiting for it in a collective). One hook per process: the first
    listener installs it, the last one gives back the function it replaced, unless something replaced the hook
    meanwhile (that replacement is left in place, and the hook then just exits).
    """

    def __init__(self) -> None:
        self._listeners: list[Callable[[int], None]] = []
        self._replaced = sys.exit

    def listen(self, listener: Callable[[int], None]) -> None:
        if not self._listeners and sys.exit is not self:
            self._replaced, sys.exit = sys.exit, self
        self._listeners.append(listener)

    def stop_listening(self, listener: Callable[[int], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)
        if not self._listeners and sys.exit is self:
            sys.exit = self._replaced

    def __call__(self, status: str | int | None = None) -> NoReturn:
        if self._listeners and threading.current_thread() is threading.main_thread():
            raise _RankZeroExit(status, self._heard)
        self._replaced(status)

    def _heard(self, code: int) -> None:
        for listener in self._listeners:
            listener(code)


#: This process's hook on ``sys.exit``.
RANK_ZERO_EXIT = RankZeroExitHook()


class _RankZeroExit(SystemExit):
    """The ``SystemExit`` of ``sys.exit`` in rank 0's main thread. When it is freed with no Python frame left, it
    ended the program, and ``on_exit`` hears its exit code; freed while code still runs, it was caught."""

    def __init__(self, status: str | int | None, on_exit: Callable[[int], None]) -> None:
        super().__init__(status)
        self._on_exit = on_exit

    def __del__(self) -> None:
        try:
            sys._getframe(1)
        except ValueError:  # no caller: the interpreter is handling the exit of the program
            self._on_exit(self.code if isinstance(self.code, int) else int(self.code is not None))
