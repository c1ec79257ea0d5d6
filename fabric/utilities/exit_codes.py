"""What a rank's exit code means for the job: one table for every launcher (in-script, spawn, ``fabric run``)."""

from __future__ import annotations

#: ``EX_TEMPFAIL``: the Trainer saved a checkpoint on SIGTERM; run the job again to continue (autoresume).
PREEMPTED_EXIT_CODE = 75


def ends_the_job(returncode: int) -> bool:
    """Whether a rank's exit is a failure that stops the others at once. Success is not; nor is preemption: every
    rank stops at the same batch and saves together, so the others are let finish their part of the save."""
    return returncode not in (0, PREEMPTED_EXIT_CODE)


def job_exit_code(returncodes: list[int]) -> int:
    """The job's code when no rank failed: 75 if any rank was preempted, else 0."""
    return PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in returncodes else 0
