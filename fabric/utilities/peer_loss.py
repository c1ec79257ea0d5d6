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


def install_lost_peer_hook(rank: int, run_directory: str | Path | None) -> None:
    """Make an uncaught peer-lost error end this rank with one line instead of a traceback: the cause is the other
    rank's failure, which its own traceback and the launcher's summary show; this rank's would only bury them.

    Under ``fabric run`` (``run_directory`` given) the rank also leaves :func:`lost_peer_marker`, so the launcher,
    which cannot read rank 0's output, can tell a consequence from the cause. Installed once per process, around the
    current ``sys.excepthook``; other errors go to it unchanged.
    """
    previous = sys.excepthook
    if getattr(previous, "reports_lost_peer", False):
        return

    def hook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        if not a_peer_left(error):
            previous(kind, error, traceback)
            return
        if run_directory is not None:
            with contextlib.suppress(OSError):  # the run directory went away: the launcher falls back to exit order
                lost_peer_marker(run_directory, rank).touch()
        print(f"fabric: {lost_peer_line(rank, error, traceback)}", file=sys.stderr, flush=True)

    hook.reports_lost_peer = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def lost_peer_line(rank: int, error: BaseException, traceback: TracebackType | None) -> str:
    """One line for a rank that failed only because another rank's process ended: Fabric's own explanation when
    the error is a Fabric collective's, else where the script was (its last frame outside torch and Fabric)."""
    if PEER_GONE_EXPLANATION in str(error):
        return str(error).splitlines()[0]
    site = _script_site(traceback)
    return (
        f"Rank {rank} failed{f' at {site}' if site else ''}: {PEER_GONE_EXPLANATION} ({type(error).__name__}). That "
        "rank's own failure is the cause; the launcher reports it."
    )


def _script_site(traceback: TracebackType | None) -> str | None:
    import traceback as tracebacks

    fabric_package = str(Path(__file__).resolve().parents[1])
    frames = [
        frame
        for frame in tracebacks.extract_tb(traceback)
        if not frame.filename.startswith(fabric_package) and "site-packages" not in frame.filename
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
