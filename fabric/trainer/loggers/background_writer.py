"""``BackgroundWriter``: values written to a store on a thread of their own, so that a slow, failing or silent store
(a tracking server in an outage) never holds the training thread, and nothing is lost while it recovers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class BackgroundWriter(Generic[T]):
    """Writes the values it is given, in order and in chunks of at most ``chunk``, with ``write`` on its own thread.

    :meth:`add` and :meth:`flush` return at once. A failed write keeps its values, in front, for the next flush; at
    most ``limit`` values are kept (the oldest dropped first, and counted in :attr:`dropped`). ``on_failure`` is
    called (on the writer's thread) with each error.
    """

    def __init__(
        self,
        write: Callable[[list[T]], None],
        on_failure: Callable[[Exception], None],
        *,
        chunk: int,
        limit: int,
        name: str,
    ) -> None:
        self._write, self._on_failure, self._chunk, self._limit = write, on_failure, chunk, limit
        self._buffer: list[T] = []
        self._condition = threading.Condition()
        self._requested = self._closing = self._busy = False
        #: The last write's error, until a write succeeds.
        self.error: Exception | None = None
        #: Values dropped because more than ``limit`` were waiting.
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """How many values are not written yet."""
        with self._condition:
            return len(self._buffer)

    def add(self, values: Iterable[T]) -> None:
        """Buffer ``values``; they are written at the next :meth:`flush`."""
        with self._condition:
            self._buffer.extend(values)
            self._trim()

    def flush(self) -> None:
        """Ask the writer to write everything buffered; returns at once."""
        with self._condition:
            self._requested = True
            self._condition.notify_all()

    def wait(self) -> None:
        """Block until every flush asked for so far was tried (written, or failed and kept)."""
        with self._condition:
            self._condition.wait_for(lambda: not self._requested and not self._busy)

    def close(self) -> None:
        """Try once more to write everything buffered, then stop the thread (waits for it)."""
        with self._condition:
            self._closing = self._requested = True
            self._condition.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._requested or self._closing)
                if not self._requested:
                    return
                self._requested, self._busy = False, True
            self._write_all()
            with self._condition:
                self._busy = False
                closing = self._closing and not self._requested
                self._condition.notify_all()
            if closing:
                return

    def _write_all(self) -> None:
        while True:
            with self._condition:
                values = self._buffer[: self._chunk]
                del self._buffer[: len(values)]
            if not values:
                return
            try:
                self._write(values)
            except Exception as error:
                with self._condition:
                    self._buffer[:0] = values
                    self._trim()
                self.error = error
                self._on_failure(error)
                return
            self.error = None

    def _trim(self) -> None:
        excess = len(self._buffer) - self._limit
        if excess > 0:
            self.dropped += excess
            del self._buffer[:excess]
