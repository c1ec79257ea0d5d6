"""Telling a rank that failed because another rank's process ended from a rank that failed by itself.

When one rank dies (an exception, ``sys.exit``, the OOM killer), its connections close and the ranks waiting for
it in a collective fail at once, often before the dead rank's process has even finished exiting. Their errors are
consequences; the first rank to fail by itself is the cause. The backends say so in their own words, listed here
once for everyone who must tell the two apart: the collective watch (its message), and the launchers (which rank's
failure they report, and which exit code the job ends with).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import TracebackType

#: What gloo and NCCL say when the process at the other end of a connection is gone.
PEER_GONE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
)
#: How long a launcher whose first failed rank only lost a peer waits to see the peer's own exit, the cause.
CAUSE_GRACE_SECONDS = 10.0
#: The first words of Fabric's own explanation of such an error (see ``CollectiveWatch``).
PEER_GONE_EXPLANATION = "another rank's process ended while this rank waited for it"


def peer_gone_text(text: str) -> bool:
    """Whether an error's text (or a rank's traceback) says the other end of a connection is gone."""
    return PEER_GONE_EXPLANATION in text or any(marker in text for marker in PEER_GONE_MARKERS)


#: What gloo's monitored barrier says when a rank did not pass it: on a timeout, a rank that never came; long
#: before the timeout, a rank whose process is gone (the barrier's receive from it failed).
MONITORED_BARRIER_FAILURE = "failed to pass monitoredBarrier"


def collective_lost_a_peer(error: BaseException, timed_out: bool) -> bool:
    """Whether a collective that raised ``error`` (after its timeout, or not) failed because a peer's process ended."""
    return a_peer_left(error) or (not timed_out and MONITORED_BARRIER_FAILURE in str(error))


def a_peer_left(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from, says another rank's process is gone."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if peer_gone_text(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def lost_peer_marker(directory: str | Path, rank: int) -> Path:
    """The file a rank leaves in the launcher's run directory when it fails only because a peer's process ended."""
    return Path(directory, f".rank{rank}.lost-peer")


def mark_lost_peer_failures(directory: str | Path, rank: int) -> None:
    """Make an uncaught peer-lost error in this process leave :func:`lost_peer_marker` before it ends, so the
    launcher that started it (``fabric run``, which cannot read rank 0's output) can tell a consequence from the
    cause. Installed once per process, around the current ``sys.excepthook``."""
    previous = sys.excepthook
    if getattr(previous, "marks_lost_peer", False):
        return

    def hook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        if a_peer_left(error):
            with contextlib.suppress(OSError):  # the run directory went away: the launcher falls back to exit order
                lost_peer_marker(directory, rank).touch()
        previous(kind, error, traceback)

    hook.marks_lost_peer = True  # type: ignore[attr-defined]
    sys.excepthook = hook
