"""Every Fabric collective (and barrier) bounded and named: who waits where, and for whom.

Each rank keeps, in memory, a small record of the last Fabric collective it entered: its number (the
ranks of a healthy job enter the same collectives in the same order), its name and the user's call site
(the first frame outside the ``fabric`` package). A daemon thread copies the record into the rendezvous
store when it changed (at most every :data:`PUBLISH_INTERVAL` seconds), so the hot path pays a counter,
a short stack walk and no network round trip.

- When a collective fails (a timeout, a peer gone), the error names it, its call site, and what every
  other rank last entered: the ranks that never entered it are the ones to look at.
- When a rank has waited in one collective longer than the stall threshold, the thread prints the same
  picture once on that rank's stderr and the rank keeps waiting until the real timeout.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from fabric.utilities.peer_loss import MONITORED_BARRIER_FAILURE, PEER_GONE_EXPLANATION, collective_lost_a_peer

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

#: Seconds between two looks of the watcher thread (publishing a changed record, checking for a stall).
PUBLISH_INTERVAL = 0.5

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: Packages whose frames sit between the user's call and the collective (``apply_to_collection``, ...).
_LIBRARY_MODULES = ("lightning_utilities", "torch")
_HINT = (
    "A collective, `fabric.barrier()` or `fabric.save()` was probably called on some ranks only (e.g. under "
    "`if fabric.global_rank == 0:`), or in a different order; call it on every rank."
)

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """One collective as entered by one rank: its number on that rank, what it is, and where it was called."""

    number: int
    name: str
    filename: str
    lineno: int
    entered_at: float

    @property
    def site(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def encode(self, waiting: bool) -> str:
        return f"{self.number}\n{self.name}\n{self.filename}\n{self.lineno}\n{int(waiting)}"


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR]
    for name in _LIBRARY_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep)
    return tuple(dirs)


def call_site() -> tuple[str, int]:
    """File and line of the innermost caller outside ``fabric`` and the libraries it calls through (the
    user's own call)."""
    skipped = _library_dirs()
    frame: Any = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def describe_records(records: dict[int, str | None], mine: Entry) -> str:
    """The other ranks' published records, relative to the collective ``mine`` this rank is in: first the
    ranks that never entered it (an earlier collective, or another one at the same position)."""
    absent, lines = [], []
    for rank, record in records.items():
        if record is None:
            absent.append(rank)
            lines.append(f"rank {rank} has entered no Fabric collective yet")
            continue
        number, name, filename, lineno, waiting = record.split("\n")
        if (int(number), name, f"{filename}:{lineno}") != (mine.number, mine.name, mine.site):
            absent.append(rank)
        state = "is waiting in" if waiting == "1" else "last entered"
        lines.append(
            f"rank {rank} {state} {name} at {filename}:{lineno} (its collective #{number}; this is #{mine.number})"
        )
    plural = "s" if len(absent) > 1 else ""
    summary = f"Rank{plural} {', '.join(map(str, absent))} never entered it" if absent else "Every rank entered it"
    return f"{summary}: {'; '.join(lines)}"


class CollectiveWatch:
    """One rank's record of its collectives, shared through ``store`` with the other ranks of the job.

    Args:
        store: the job's rendezvous store (every rank's client of the same server).
        rank, world_size: this rank and the number of ranks.
        timeout: the collectives' timeout, quoted in the messages.
        stall_threshold: seconds after which a rank still waiting in one collective reports it; 0 turns
            the report off.
    """

    def __init__(self, store: Store, rank: int, world_size: int, timeout: timedelta, stall_threshold: float) -> None:
        from torch.distributed.distributed_c10d import PrefixStore

        self._store = PrefixStore("fabric/collectives", store)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.stall_threshold = stall_threshold
        self._count = 0
        self._last: Entry | None = None
        self._waiting: Entry | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="fabric-collective-watch")
        self._thread.start()

    def call(self, name: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run the collective ``function(*args, **kwargs)`` as this rank's next collective, named ``name``."""
        return self._run(name, function, args, kwargs, explain_any_error=True)

    def call_computation(self, name: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``function``, a computation with a collective inside (a backward pass and its gradient all-reduce),
        as this rank's next collective: published and stall-reported like one. Only an error after (nearly)
        the whole timeout is explained as a wait for the others; the computation's own errors (a shape
        mismatch, DDP's unused-parameter check) pass unchanged."""
        return self._run(name, function, args, kwargs, explain_any_error=False)

    def _run(
        self,
        name: str,
        function: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        explain_any_error: bool,
    ) -> T:
        self._count += 1
        entry = Entry(self._count, name, *call_site(), time.monotonic())
        self._last = self._waiting = entry
        try:
            return function(*args, **kwargs)
        except RuntimeError as error:
            if collective_lost_a_peer(error, self._timed_out(entry)):
                raise CollectiveError(self._explain_peer_gone(entry, error)) from error
            if explain_any_error or self._timed_out(entry):
                raise CollectiveError(self._explain(entry, error)) from error
            raise
        finally:
            self._waiting = None

    def stop(self) -> None:
        """End the watcher thread (before the store goes away)."""
        self._stop.set()
        self._thread.join(timeout=5 * PUBLISH_INTERVAL)

    def others(self, mine: Entry) -> str:
        """What every other rank last published, relative to ``mine``."""
        records: dict[int, str | None] = {}
        for rank in range(self.world_size):
            key = str(rank)
            if rank != self.rank:
                records[rank] = self._store.get(key).decode() if self._store.check([key]) else None
        return describe_records(records, mine)

    def _timed_out(self, entry: Entry) -> bool:
        return time.monotonic() - entry.entered_at >= 0.9 * self.timeout.total_seconds()

    def _explain(self, entry: Entry, error: RuntimeError) -> str:
        head = (
            f"Rank {self.rank} waited {self.timeout} for the others"
            if self._timed_out(entry)
            else f"Rank {self.rank} failed after {time.monotonic() - entry.entered_at:.1f} s"
        )
        try:
            others = self.others(entry)
        except Exception as store_error:  # the store lives in rank 0, which may be gone
            others = f"What the other ranks entered is unknown (the store is unreachable: {store_error})"
        return f"{head} in {entry.name}, called at {entry.site}: {error}\n{others}.\n{_HINT}"

    def _explain_peer_gone(self, entry: Entry, error: RuntimeError) -> str:
        """Not a mismatch of collectives: the rank at the other end died, and its own failure is the cause."""
        # gloo's monitored barrier quotes its timeout ("in 1800000 ms") although it failed at once: leave it out
        detail = "" if MONITORED_BARRIER_FAILURE in str(error) else f" ({error})"
        return (
            f"Rank {self.rank} failed in {entry.name}, called at {entry.site}: {PEER_GONE_EXPLANATION}{detail}. "
            "That rank's own failure (an exception, sys.exit, a signal such as the out-of-memory killer's SIGKILL) is "
            "the cause; the launcher reports it."
        )

    def _watch(self) -> None:
        published: tuple[Entry | None, bool] | None = None
        reported: Entry | None = None
        while True:
            last, waiting = self._last, self._waiting
            state = (last, waiting is not None and waiting is last)
            try:
                if state != published and last is not None:
                    self._store.set(str(self.rank), last.encode(state[1]))
                published = state
                if (
                    waiting is not None
                    and waiting is not reported
                    and self.stall_threshold > 0
                    and time.monotonic() - waiting.entered_at >= self.stall_threshold
                ):
                    reported = waiting
                    self._report_stall(waiting)
            except Exception:  # the job is ending (store gone): nothing left to watch
                return
            if self._stop.wait(PUBLISH_INTERVAL):
                return

    def _report_stall(self, entry: Entry) -> None:
        print(
            f"fabric: rank {self.rank} has waited {self.stall_threshold:g} s in {entry.name}, called at {entry.site}. "
            f"{self.others(entry)}. It keeps waiting until the timeout ({self.timeout}).",
            file=sys.stderr,
            flush=True,
        )


class CollectiveError(RuntimeError):
    """A Fabric collective failed (usually timed out); the message says where, and what the other ranks did."""
