"""Child processes that belong to their rank: they die with it, and a scheduler's SIGTERM is the rank's to handle.

SLURM (``scancel``, a time limit) and a terminal send SIGTERM to every process of the job, DataLoader workers
included. A worker that dies of it makes the rank's next batch raise ("DataLoader worker ... is killed by signal:
Terminated") before the Trainer could save. So workers Fabric sets up take SIGTERM only from their rank (which
stops them that way at exit) and ignore it from anyone else: the rank decides (the Trainer saves, then exits),
and its workers end with it, at the latest by the kernel's parent-death signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), so it is never orphaned.

    Run in a child: before ``exec`` for a started rank, first thing in a DataLoader worker.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class RankOwnedWorker:
    """A DataLoader ``worker_init_fn`` that makes the worker its rank's (see the module), then runs ``then``.

    A class, not a closure, so loaders with the ``spawn`` start method can pickle it.
    """

    def __init__(self, then: Callable[[int], None] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        take_sigterm_only_from_parent()
        die_with_parent()
        if self.then is not None:
            self.then(worker_id)


def take_sigterm_only_from_parent() -> None:
    """SIGTERM from this process's parent ends it (``os._exit(0)``, as torch's own worker handler does); from
    anyone else it is ignored. A thread waits for the signal, blocked everywhere else, to learn who sent it."""
    parent = os.getppid()
    terminate = {signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, terminate)

    def serve() -> None:
        while signal.sigwaitinfo(terminate).si_pid != parent:
            pass
        os._exit(0)

    threading.Thread(target=serve, daemon=True, name="fabric-worker-sigterm").start()
