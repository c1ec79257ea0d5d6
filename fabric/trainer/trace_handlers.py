"""Trace handlers: the Trainer's phases as a trace file of their own, beside ``torch.profiler``'s (Composer's
``Profiler(trace_handlers=[JSONTraceHandler(...)])``).

While the :class:`~fabric.trainer.profiler.Profiler` records, it hands each handler the Trainer's ranges
(``trainer/forward``, ``trainer/backward``, ... as in its table) with their times; when a recorded cycle ends the
handler writes them. :class:`JSONTraceHandler` writes Chrome trace files (``chrome://tracing``, Perfetto): one per
rank and cycle, and at the end of ``fit()`` one merged file of every rank's cycles on rank 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typing_extensions import override

#: Fields a JSONTraceHandler file name may use.
_FILENAME_FIELDS = {"run_name": "run", "epoch": 0, "batch": 0, "rank": 0}


class TraceHandler:
    """Receives the Trainer's ranges while the profiler records, and the ends of recorded cycles."""

    def start(self, run_name: str, rank: int) -> None:
        """A ``fit()`` begins, on global rank ``rank``."""

    def begin(self, name: str, time_ns: int) -> None:
        """The range ``name`` opens at ``time_ns`` (``time.perf_counter_ns``)."""

    def end(self, name: str, time_ns: int) -> None:
        """The range ``name`` closes at ``time_ns``."""

    def cycle_end(self, epoch: int, batch: int) -> None:
        """A recorded cycle ended after batch ``batch`` of epoch ``epoch``: write what it recorded."""

    def fit_end(self, barrier: Callable[[], None]) -> None:
        """The ``fit()`` ended on every rank (``barrier()`` waits for all of them)."""


class JSONTraceHandler(TraceHandler):
    """Writes the Trainer's ranges as Chrome trace JSON: ``folder/filename`` per rank and recorded cycle
    (``{run_name}``, ``{epoch}``, ``{batch}``, ``{rank}``), and on rank 0 ``merged_trace_filename`` with every rank's
    cycles once ``fit()`` ends (``None``: no merged file). Unless ``overwrite=True`` the folder must hold no file of
    an earlier run (checked when the first ``fit()`` starts), as in Composer."""

    def __init__(
        self,
        folder: str = "{run_name}/traces",
        filename: str = "ep{epoch}-ba{batch}-rank{rank}.json",
        merged_trace_filename: str | None = "merged_trace.json",
        overwrite: bool = False,
    ) -> None:
        for name, value in {"filename": filename, "merged_trace_filename": merged_trace_filename}.items():
            if value is not None and ("/" in value or os.sep in value):
                raise ValueError(f"{name}={value!r} must be a file name without folders; put folders in folder.")
        for name, value in {"folder": folder, "filename": filename}.items():
            try:
                value.format(**_FILENAME_FIELDS)
            except (KeyError, IndexError, ValueError) as error:
                fields = ", ".join(f"{{{field}}}" for field in _FILENAME_FIELDS)
                raise ValueError(f"{name}={value!r} may use only {fields}: {error!r}") from None
        self.folder, self.filename, self.merged_trace_filename = folder, filename, merged_trace_filename
        self.overwrite = overwrite
        #: Every file this handler wrote on this rank, in order.
        self.traces: list[Path] = []
        self._events: list[dict[str, Any]] = []
        self._run_name, self._rank = "run", 0
        self._checked = False

    @override
    def start(self, run_name: str, rank: int) -> None:
        self._run_name, self._rank = run_name, rank
        folder = self._folder()
        if not self._checked and not self.overwrite and folder.is_dir() and any(folder.iterdir()):
            raise FileExistsError(
                f"JSONTraceHandler: {os.fspath(folder)!r} already holds traces; use another folder, empty it, or "
                "pass overwrite=True."
            )
        self._checked = True

    @override
    def begin(self, name: str, time_ns: int) -> None:
        self._events.append(self._event(name, "B", time_ns))

    @override
    def end(self, name: str, time_ns: int) -> None:
        self._events.append(self._event(name, "E", time_ns))

    @override
    def cycle_end(self, epoch: int, batch: int) -> None:
        if not self._events:
            return
        path = self._folder() / self.filename.format(run_name=self._run_name, epoch=epoch, batch=batch, rank=self._rank)
        _write_trace(path, self._events)
        self._events = []
        self.traces.append(path)

    @override
    def fit_end(self, barrier: Callable[[], None]) -> None:
        barrier()  # every rank's cycle files are written
        if self._rank != 0 or self.merged_trace_filename is None:
            return
        merged_path = self._folder() / self.merged_trace_filename
        events: list[dict[str, Any]] = []
        for path in sorted(self._folder().glob("*.json")):
            if path != merged_path:
                events.extend(json.loads(path.read_text())["traceEvents"])
        _write_trace(merged_path, sorted(events, key=lambda event: (event["pid"], event["ts"])))
        self.traces.append(merged_path)

    def _folder(self) -> Path:
        return Path(self.folder.format(run_name=self._run_name, epoch=0, batch=0, rank=self._rank))

    def _event(self, name: str, phase: str, time_ns: int) -> dict[str, Any]:
        return {"name": name, "ph": phase, "ts": time_ns / 1000, "pid": self._rank, "tid": 0, "cat": "trainer"}


def _write_trace(path: Path, events: list[dict[str, Any]]) -> None:
    """A Chrome trace file, written whole under a temporary name and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    os.replace(temporary, path)
