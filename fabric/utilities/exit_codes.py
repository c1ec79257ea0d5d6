"""Which exit code a job ends with: one table for the launchers that start ranks as processes and watch them end,
``python train.py`` (``fabric.launch()``) and ``fabric run model``.

A rank's exit *fails* the job when it is non-zero, except 75 (``EX_TEMPFAIL``, preemption): every rank stops at the
same batch and saves together, so the others are let finish their part of the save. Rank 0 of ``python train.py`` is
the launcher itself and the others cannot outlive it: any code it leaves with ends the job, 75 included. Given the
ranks' exits as the launcher saw them end, :func:`job_exit_code` picks the job's code (tested row by row in
``tests/utilities/test_exit_codes.py``):

=============================================================  ================================================
What happened                                                  The job's exit code
=============================================================  ================================================
every rank ended with 0                                        0
no rank failed; one or more were preempted                     75
a rank failed: it raised, called ``sys.exit(N)``, or a         the first failing rank's: 1, N, 128 + S
signal S killed it (SIGKILL, e.g. the OOM killer: 137)
the first rank to fail only lost a peer (its collective lost   the first rank that failed by itself
the connection), and another rank failed by itself
every failed rank only lost a peer                             the first failing rank's
rank 0 of ``python train.py`` left with ``sys.exit(N)``,       N: rank 0 is the first failure
N != 0, and another rank failed after it
the launcher got SIGTERM and every rank exited in time         the first non-zero code in rank order (75 when
                                                               they saved), else 0
the launcher got SIGTERM and had to kill a rank; or SIGINT;    128 + the signal: 143, 130
or a second signal; or no rank had started yet
=============================================================  ================================================

Under ``python train.py`` the interpreter ends rank 0's process with rank 0's own code unless a child failed first:
the ranks agree on preemption, so that is the table's code too. ``launch(fn)`` under ``ddp_spawn``/``ddp_fork``
raises in the calling process instead (``RankFailedError``); see docs/failures.md for every launcher's messages.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

#: ``EX_TEMPFAIL``: the Trainer saved a checkpoint on SIGTERM; run the job again to continue (autoresume).
PREEMPTED_EXIT_CODE = 75


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended, as far as its launcher can tell."""

    rank: int
    #: As ``subprocess`` reports it: ``-S`` for a process killed by signal S.
    returncode: int
    #: Its error says another rank's process ended first: a consequence of that rank's failure, not a cause.
    lost_a_peer: bool = False
    #: Rank 0 of ``python train.py``, the process that launched the others.
    is_launcher: bool = False

    @property
    def failed(self) -> bool:
        """Whether this exit ends the job (see the module docstring)."""
        return self.returncode != 0 and (self.is_launcher or self.returncode != PREEMPTED_EXIT_CODE)


def shell_exit_code(returncode: int) -> int:
    """The exit code a shell reports: a process killed by signal S (``returncode == -S``) gives 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def failure_cause(exits: Sequence[RankExit]) -> RankExit | None:
    """The failure the job reports, among ``exits`` in the order the ranks ended: the first that failed by itself,
    else the first that failed; ``None`` when none failed."""
    failures = [rank_exit for rank_exit in exits if rank_exit.failed]
    return next((failure for failure in failures if not failure.lost_a_peer), failures[0] if failures else None)


def job_exit_code(exits: Sequence[RankExit], stop_signal: int | None = None, killed: bool = False) -> int:
    """The job's exit code (the table in the module docstring).

    ``exits``: the ranks' exits in the order they ended; ``stop_signal``: the signal that made the launcher stop the
    ranks, if one did; ``killed``: whether it then had to kill a rank.
    """
    if stop_signal is not None:
        if stop_signal != signal.SIGTERM or killed or not exits:
            return 128 + stop_signal
        by_rank = sorted(exits, key=lambda rank_exit: rank_exit.rank)
        return next((shell_exit_code(e.returncode) for e in by_rank if e.returncode != 0), 0)
    cause = failure_cause(exits)
    if cause is not None:
        return shell_exit_code(cause.returncode)
    return PREEMPTED_EXIT_CODE if any(e.returncode == PREEMPTED_EXIT_CODE for e in exits) else 0
