"""Process helpers shared by every launcher that starts ranks as OS processes (torch-free: the CLI uses them)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterable

#: How long stopped ranks get to exit on SIGTERM (e.g. to write a checkpoint) before SIGKILL.
TERMINATION_GRACE_SECONDS = 5.0


def stop_processes(processes: Iterable[subprocess.Popen[bytes]], grace: float = TERMINATION_GRACE_SECONDS) -> None:
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


def exit_code(returncode: int) -> int:
    """The exit code a shell reports: a process killed by signal N (``returncode == -N``) gives 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"{exit_code(returncode)} (killed by {signal.Signals(-returncode).name})"
    return str(returncode)


def die_with_parent() -> None:
    """Run in a child before exec: the kernel SIGKILLs it if its parent dies (Linux), so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
