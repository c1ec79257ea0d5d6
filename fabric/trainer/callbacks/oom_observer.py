"""``OOMObserver``: when CUDA runs out of memory, dump what was allocated (and by which code) for the post-mortem."""

from __future__ import annotations

import os
import pickle
import warnings
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from fabric.trainer.callbacks._utils import (
    check_count,
    check_file_name,
    check_local_files,
    check_name,
    format_name,
    training_device,
    uses_clock,
)
from fabric.trainer.core.callback import Callback
from fabric.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

#: The files written per out-of-memory error: ``<filename><suffix>``, as Composer names them.
SNAPSHOT_SUFFIX = "_snapshot.pickle"
TRACE_PLOT_SUFFIX = "_trace_plot.html"
SEGMENT_PLOT_SUFFIX = "_segment_plot.html"


class OOMObserver(Callback):
    """On a CUDA out-of-memory error, writes the allocator's memory snapshot, with the recent allocation history.

    At ``INIT`` it starts CUDA's allocation history (``torch.cuda.memory._record_memory_history``, the last
    ``max_entries`` allocations and frees with their stack traces) and attaches an observer
    (``torch._C._cuda_attach_out_of_memory_observer``) that the allocator calls when it is about to raise
    ``OutOfMemoryError``, before anything is freed. The observer writes, in ``folder``:

    * ``<filename>_snapshot.pickle``: ``torch.cuda.memory._snapshot()``, to open at https://pytorch.org/memory_viz;
    * ``<filename>_trace_plot.html`` and ``<filename>_segment_plot.html``: the same, as self-contained pages.

    ``folder`` may use ``{run_name}`` and ``{rank}``; ``filename`` also the clock's fields (``{batch}``,
    ``{epoch}``, ...). Every rank writes its own files. Without ``overwrite``, files left by an earlier run
    under the same names are an error at ``INIT`` (a name with clock fields is not checked). Recording the
    history slows allocations a little. ``MemorySnapshot`` stopping its recording stops this one's too.

    Only CUDA has this allocator: on other devices it warns once and does nothing. ``remote_file_name``
    (Composer's upload of the files) is not supported: it must be None.
    """

    def __init__(
        self,
        max_entries: int = 100_000,
        folder: str = "{run_name}/torch_traces",
        filename: str = "rank{rank}_oom",
        remote_file_name: str | None = None,
        overwrite: bool = False,
    ) -> None:
        overwrite = check_local_files("OOMObserver", remote_file_name, overwrite)
        self.max_entries = check_count(max_entries, "max_entries", 1)
        self.folder = check_name(folder, "folder", ("run_name", "rank"))
        self.filename = check_file_name(filename, "filename")
        self.remote_file_name = remote_file_name
        self.overwrite = overwrite
        #: Files written by the observer, on this rank.
        self.written: list[str] = []
        self._state: State | None = None
        self._set_up = False
        self._enabled = False

    @override
    def init(self, state: State, logger: Logger) -> None:
        self._set_up_once(state)

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        self._set_up_once(state)  # when INIT was not seen (a callback added to a running trainer)

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        """Stop recording; the observer cannot be detached, so it stays but does nothing."""
        if self._enabled:
            self._enabled = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def _set_up_once(self, state: State) -> None:
        if self._set_up:
            return
        self._set_up = True
        device = training_device(state)
        if device.type != "cuda":
            rank_zero_warn(f"OOMObserver needs CUDA, but the model trains on {device.type}: it will do nothing.")
            return
        self._state = state
        folder = format_name(self.folder, state)
        if not self.overwrite and not uses_clock(self.filename):
            prefix = os.path.join(folder, format_name(self.filename, state))
            existing = [prefix + suffix for suffix in _SUFFIXES if os.path.exists(prefix + suffix)]
            if existing:
                raise FileExistsError(
                    f"OOMObserver would overwrite {existing}, left by an earlier run; pass overwrite=True, "
                    "another folder, or a filename with {batch}."
                )
        os.makedirs(folder, exist_ok=True)
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=self.max_entries)
        torch._C._cuda_attach_out_of_memory_observer(self._on_out_of_memory)  # type: ignore[attr-defined]
        self._enabled = True

    def _on_out_of_memory(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        """Called by the CUDA allocator as it is about to raise OutOfMemoryError; must not raise itself."""
        state = self._state
        if not self._enabled or state is None:
            return
        prefix = os.path.join(format_name(self.folder, state), format_name(self.filename, state))
        try:
            snapshot = torch.cuda.memory._snapshot()
            with open(prefix + SNAPSHOT_SUFFIX, "wb") as file:
                pickle.dump(snapshot, file)
            self.written.append(prefix + SNAPSHOT_SUFFIX)
            from torch.cuda import _memory_viz

            pages: tuple[tuple[str, Any], ...] = (
                (TRACE_PLOT_SUFFIX, _memory_viz.trace_plot),
                (SEGMENT_PLOT_SUFFIX, _memory_viz.segment_plot),
            )
            for suffix, page in pages:
                with open(prefix + suffix, "w") as file:
                    file.write(page(snapshot))
                self.written.append(prefix + suffix)
        except Exception as error:  # the out-of-memory error is what the user must see, not ours
            warnings.warn(f"OOMObserver could not write the memory snapshot to {prefix}*: {error!r}", stacklevel=2)
            return
        warnings.warn(  # every rank: each writes its own snapshot
            f"CUDA out of memory on device {device} (asked for {alloc} bytes; {device_alloc} allocated, "
            f"{device_free} free): the memory snapshot is in {prefix}{SNAPSHOT_SUFFIX} (open it at "
            "https://pytorch.org/memory_viz).",
            stacklevel=2,
        )


_SUFFIXES = (SNAPSHOT_SUFFIX, TRACE_PLOT_SUFFIX, SEGMENT_PLOT_SUFFIX)
