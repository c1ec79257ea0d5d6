"""``FileLogger``: appends every logged value to a plain text file, one ``[batch=N] name: value`` line each."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from typing_extensions import override

from fabric.trainer.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class FileLogger(LoggerDestination):
    """Writes ``[batch=12] loss/train/total: 0.25`` lines to ``filename`` (appending; parent directories made).

    Lines go through the file's buffer (``buffer_size`` as in :func:`open`; -1 is the system default)
    and are flushed to disk every ``flush_interval`` batches and on :meth:`close`, so logging every
    batch does not cost a write system call each time. Hyperparameters get ``[hyperparameter]`` lines.
    The file opens on the first value, so a run that logs nothing leaves no file behind.
    """

    def __init__(self, filename: str | os.PathLike[str], flush_interval: int = 100, buffer_size: int = -1) -> None:
        if isinstance(flush_interval, bool) or not isinstance(flush_interval, int) or flush_interval < 1:
            raise ValueError(f"flush_interval must be a whole number of batches, at least 1; got {flush_interval!r}.")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size == 0 or buffer_size < -1:
            raise ValueError(
                f"buffer_size must be -1 (system default), 1 (line buffered) or a buffer size in bytes; "
                f"got {buffer_size!r}."
            )
        self.filename = Path(filename)
        self.flush_interval = flush_interval
        self.buffer_size = buffer_size
        self._file: TextIO | None = None

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._write("".join(f"[batch={step}] {name}: {value}\n" for name, value in metrics.items()))

    @override
    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        self._write("".join(f"[hyperparameter] {name}: {value}\n" for name, value in hyperparameters.items()))

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        if self._file is not None and int(state.timestamp.batch) % self.flush_interval == 0:
            self._file.flush()

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        """Flush and close the file; a value logged afterwards reopens it and appends."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, text: str) -> None:
        if self._file is None:
            self.filename.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.filename.open("a", buffering=self.buffer_size, encoding="utf-8")
        self._file.write(text)
