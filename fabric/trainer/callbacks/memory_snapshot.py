"""``MemorySnapshot``: record CUDA's allocations over a few batches and dump them, to see what fills the memory."""

from __future__ import annotations

import os
import pickle
import warnings
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from fabric.trainer.callbacks._utils import (
    check_count,
    check_file_name,
    check_interval,
    check_local_files,
    check_name,
    format_name,
    training_device,
)
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.time import Time
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class MemorySnapshot(Callback):
    """Records every CUDA allocation and free, with stack traces, over one window of training, then writes them.

    After ``skip_batches`` batches (the first ones allocate the optimizer state and warm caches up), recording
    starts at ``BATCH_START`` and lasts ``interval`` (``'3ba'``, ``'1ep'`` or a number of batches): at the
    ``BATCH_END`` that completes it, every rank writes in ``folder``

    * ``<filename>.pickle``: ``torch.cuda.memory._snapshot()``, to open at https://pytorch.org/memory_viz;
    * ``<filename>.html``: its allocation timeline as a self-contained page (``torch.cuda._memory_viz.trace_plot``),

    then recording stops (once per callback, as in Composer). ``max_entries`` caps the events kept.
    ``folder`` may use ``{run_name}`` and ``{rank}``, ``filename`` also the clock's fields (``{batch}`` is the
    batch count when writing). Without ``overwrite`` an existing file is left alone, with a warning. Stopping
    the recording also stops ``OOMObserver``'s, which shares the allocator's one history.

    Only CUDA has this allocator: on other devices it warns once and does nothing. ``remote_file_name``
    (Composer's upload of the files) is not supported: it must be None.
    """

    def __init__(
        self,
        skip_batches: int = 1,
        interval: int | str | Time[int] = "3ba",
        max_entries: int = 100_000,
        folder: str = "{run_name}/torch_traces",
        filename: str = "rank{rank}.{batch}.memory_snapshot",
        remote_file_name: str | None = None,
        overwrite: bool = False,
    ) -> None:
        overwrite = check_local_files("MemorySnapshot", remote_file_name, overwrite)
        self.skip_batches = check_count(skip_batches, "skip_batches", 0)
        self.interval = check_interval(interval, "interval")
        self.max_entries = check_count(max_entries, "max_entries", 1)
        self.folder = check_name(folder, "folder", ("run_name", "rank"))
        self.filename = check_file_name(filename, "filename")
        self.remote_file_name = remote_file_name
        self.overwrite = overwrite
        #: Files written, on this rank.
        self.written: list[str] = []
        self._batches_to_skip = skip_batches
        self._started_at: int | None = None  # the clock, in the interval's unit, when recording started
        self._enabled: bool | None = None  # None until the device is known

    @override
    def init(self, state: State, logger: Logger) -> None:
        self._check_device(state)

    @override
    def batch_start(self, state: State, logger: Logger) -> None:
        if self._check_device(state) and self._started_at is None and self._batches_to_skip == 0:
            torch.cuda.memory._record_memory_history(enabled="all", max_entries=self.max_entries)
            self._started_at = int(state.timestamp.get(self.interval.unit))

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        if not self._enabled:
            return
        if self._batches_to_skip > 0:
            self._batches_to_skip -= 1
            return
        started = self._started_at
        if started is not None and int(state.timestamp.get(self.interval.unit)) >= started + self.interval.value:
            try:
                self._write(state)
            finally:
                self._stop()

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        """Stop a recording that training ended in the middle of."""
        self._stop()

    def _check_device(self, state: State) -> bool:
        """Whether training runs on CUDA; warns once when it does not."""
        if self._enabled is None:
            device = training_device(state)
            self._enabled = device.type == "cuda"
            if not self._enabled:
                rank_zero_warn(f"MemorySnapshot needs CUDA, but the model trains on {device.type}: it will do nothing.")
        return self._enabled

    def _stop(self) -> None:
        if self._started_at is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._started_at = None
            self._enabled = False  # one window per callback

    def _write(self, state: State) -> None:
        folder = format_name(self.folder, state)
        prefix = os.path.join(folder, format_name(self.filename, state))
        paths = [prefix + ".pickle", prefix + ".html"]
        existing = [path for path in paths if os.path.exists(path)]
        if existing and not self.overwrite:
            warnings.warn(f"MemorySnapshot left {existing} alone: pass overwrite=True to replace them.", stacklevel=2)
            return
        snapshot = torch.cuda.memory._snapshot()
        if not any(snapshot.get("device_traces", ())):
            warnings.warn("MemorySnapshot recorded no allocation, so it wrote nothing.", stacklevel=2)
            return
        os.makedirs(folder, exist_ok=True)
        with open(paths[0], "wb") as file:
            pickle.dump(snapshot, file)
        self.written.append(paths[0])
        from torch.cuda import _memory_viz

        with open(paths[1], "w") as file:
            file.write(_memory_viz.trace_plot(snapshot))  # type: ignore[no-untyped-call]
        self.written.append(paths[1])
