"""Process helpers shared by every launcher that starts ranks as OS processes (torch-free: the CLI uses them)."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from fabric.utilities.exit_codes import PREEMPTED_EXIT_CODE, shell_exit_code

#: How long stopped ranks get to exit on SIGTERM (e.g. to write a checkpoint) before SIGKILL.
TERMINATION_GRACE_SECONDS = 5.0


class RankProcess(Protocol):
    """What supervising a rank's process takes: ``subprocess.Popen`` has it (spawned ranks get an adapter)."""

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def stop_processes(processes: Iterable[RankProcess], grace: float = TERMINATION_GRACE_SECONDS) -> None:
    """SIGTERM every process still running, then SIGKILL whatever is left after ``grace`` seconds."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    for process in running:
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def exits_in_order(processes: Mapping[int, RankProcess]) -> Iterator[tuple[int, int]]:
    """``(local rank, returncode)`` of each process as it ends, first to end first.

    One daemon thread waits for each process, so only these processes are reaped (never other children of
    the caller, such as dataloader workers), and the caller may stop iterating at the first failure.
    """
    ended: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()

    def wait(local_rank: int, process: RankProcess) -> None:
        ended.put((local_rank, process.wait()))

    for local_rank, process in processes.items():
        threading.Thread(target=wait, args=(local_rank, process), daemon=True, name=f"fabric-rank-{local_rank}").start()
    for _ in processes:
        yield ended.get()


def describe_exit(returncode: int, oom_kills_before: int | None = None) -> str:
    """The exit code and, for a signal, its name; for SIGKILL whether the kernel's OOM killer struck (if
    ``oom_kills_before``, the :func:`oom_kill_count` from before the process started, tells)."""
    if returncode == PREEMPTED_EXIT_CODE:
        return f"{returncode} (preempted: it saved a checkpoint; run the job again to resume)"
    if returncode >= 0:
        return str(returncode)
    name = signal.Signals(-returncode).name
    if -returncode != signal.SIGKILL:
        return f"{shell_exit_code(returncode)} (killed by {name})"
    oom_kills = oom_kill_count()
    if oom_kills_before is not None and oom_kills is not None and oom_kills > oom_kills_before:
        cause = "likely out of memory: the kernel's OOM killer killed a process of this cgroup meanwhile"
    else:
        cause = "often the out-of-memory killer"
    return f"{shell_exit_code(returncode)} (killed by {name}, {cause})"


#: Where the kernel counts OOM kills of this process's memory cgroup: cgroup v2, then v1.
_OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")


def oom_kill_count() -> int | None:
    """How many processes the OOM killer has killed in this process's memory cgroup; ``None`` if unknown."""
    for path in _OOM_COUNTERS:
        try:
            with open(path) as counters:
                for line in counters:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None
