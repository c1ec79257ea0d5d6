"""``TraceProfiler``: ``torch.profiler`` on a wait/warmup/active/repeat schedule, one Chrome trace per rank and cycle.

For custom loops (the Trainer's :class:`~fabric.trainer.profiler.Profiler` builds on it)::

    with fabric.profiler("traces", wait=1, warmup=1, active=3) as profiler:
        for batch in loader:
            with profiler.range("forward"):
                loss = model(batch)
            ...
            profiler.step()  # once per batch
    print(profiler.traces)   # [Path("traces/rank0.5.pt.trace.json")]

The schedule counts ``step()`` calls: after ``skip_first`` steps, cycles of ``wait`` idle steps,
``warmup`` steps (profiling, results dropped) and ``active`` recorded steps, ``repeat`` times (0:
until stopped). At the end of each active cycle the trace is written to ``folder/filename``, whose
``{rank}`` and ``{batch}`` (the step count at that moment) are filled in. Ranges opened with
:meth:`range` or :meth:`begin`/:meth:`end` appear as named spans (``user_annotation`` events) when the
profiler records, and cost nothing otherwise.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.profiler

_SCHEDULE_MINIMUM = {"skip_first": 0, "wait": 0, "warmup": 0, "active": 1, "repeat": 0}


def check_schedule(schedule: dict[str, int]) -> None:
    """Fail naming the bad value unless ``skip_first``/``wait``/``warmup``/``repeat`` are >= 0 and ``active`` >= 1."""
    for name, value in schedule.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < _SCHEDULE_MINIMUM[name]:
            raise ValueError(f"{name}={value!r} must be a whole number of batches, at least {_SCHEDULE_MINIMUM[name]}.")


def check_filename(filename: str) -> None:
    """Fail unless ``filename`` is a plain file name whose only fields are ``{rank}`` and ``{batch}``."""
    if "/" in filename or os.sep in filename:
        raise ValueError(f"filename={filename!r} must be a file name without folders; put folders in folder.")
    try:
        filename.format(rank=0, batch=0)
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(f"filename={filename!r} may use only {{rank}} and {{batch}}: {error!r}") from None


def check_memory_timeline(filename: str, profile_memory: bool, record_shapes: bool, with_stack: bool) -> None:
    """Fail now, naming what is missing, unless torch can write a memory timeline to ``filename``: it needs
    ``profile_memory``, ``record_shapes`` and ``with_stack``, and an ``.html`` file needs matplotlib."""
    check_filename(filename)
    missing = [
        name
        for name, on in {
            "profile_memory": profile_memory,
            "record_shapes": record_shapes,
            "with_stack": with_stack,
        }.items()
        if not on
    ]
    if missing:
        needed = ", ".join(f"{name}=True" for name in missing)
        raise ValueError(f"A memory timeline ({filename!r}) needs {needed}, as torch records it.")
    if filename.endswith(".html"):
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError(
                f"A memory timeline as HTML ({filename!r}) needs matplotlib (pip install matplotlib); a .json or "
                ".json.gz name writes the raw timeline without it."
            )


class TraceProfiler:
    """Profiles steps with ``torch.profiler`` as the schedule says; writes one trace per rank and active cycle."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        rank: int = 0,
        skip_first: int = 0,
        wait: int = 0,
        warmup: int = 1,
        active: int = 4,
        repeat: int = 1,
        filename: str = "rank{rank}.{batch}.pt.trace.json",
        first_step: int = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        memory_filename: str | None = None,
    ) -> None:
        schedule = {"skip_first": skip_first, "wait": wait, "warmup": warmup, "active": active, "repeat": repeat}
        check_schedule(schedule)
        check_filename(filename)
        if memory_filename is not None:
            check_memory_timeline(memory_filename, profile_memory, record_shapes, with_stack)
        self.folder = Path(folder)
        self.rank = rank
        self.schedule = schedule
        self.filename = filename
        #: Where each cycle's memory timeline goes (``{rank}``, ``{batch}``); ``None``: none is written.
        self.memory_filename = memory_filename
        self.options = {
            "record_shapes": record_shapes,
            "profile_memory": profile_memory,
            "with_stack": with_stack,
            "with_flops": with_flops,
        }
        #: The step count ``{batch}`` starts from (the Trainer passes the batches already trained).
        self.first_step = first_step
        #: The trace files written so far, in order (memory timelines too).
        self.traces: list[Path] = []
        self._profile: torch.profiler.profile | None = None
        self._open: list[tuple[str, Any]] = []
        self._discard = False

    @property
    def recording(self) -> bool:
        """Whether the current step is being recorded (ranges then appear in the trace)."""
        if self._profile is None:
            return False
        from torch.profiler import ProfilerAction

        return self._profile.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)

    def start(self) -> None:
        """Start counting steps (step ``first_step``); profiling begins when the schedule says."""
        if self._profile is not None:
            raise RuntimeError("This TraceProfiler is already running; stop() it before starting it again.")
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
        self._profile = profile(
            activities=activities,
            schedule=schedule(**self.schedule),
            on_trace_ready=self._write_trace,
            record_shapes=self.options["record_shapes"],
            profile_memory=self.options["profile_memory"],
            with_stack=self.options["with_stack"],
            with_flops=self.options["with_flops"],
        )
        self._profile.start()

    def step(self) -> None:
        """Mark the end of one step (batch); writes a trace when an active cycle ends."""
        if self._profile is None:
            raise RuntimeError("TraceProfiler.step() before start(): use it as a context manager or call start().")
        self._close_ranges()
        # torch-workaround(profiler-cycle-warning): torch warns that each cycle's events are cleared, which is the
        # point: one trace per cycle
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
            self._profile.step()

    def stop(self) -> None:
        """Stop profiling; a recording cycle with a finished step is cut short and written, other cycles dropped.

        Safe to call twice.
        """
        if self._profile is not None:
            self._close_ranges()
            # torch would also write a cycle that only warmed up, or whose first recorded step never ran.
            self._discard = not self.recording or self._finished_active_steps() == 0
            profile, self._profile = self._profile, None
            profile.stop()
            self._discard = False

    def begin(self, name: str) -> None:
        """Open a named range (when recording); :meth:`end` or the next :meth:`step` closes it."""
        if self.recording:
            from torch.autograd.profiler import record_function

            span = record_function(name)
            span.__enter__()  # type: ignore[no-untyped-call]
            self._open.append((name, span))

    def end(self, name: str) -> None:
        """Close the innermost open range called ``name`` and those opened inside it; nothing if none is open."""
        names = [open_name for open_name, _ in self._open]
        if name in names:
            index = len(names) - 1 - names[::-1].index(name)
            while len(self._open) > index:
                self._open.pop()[1].__exit__(None, None, None)

    @contextmanager
    def range(self, name: str) -> Iterator[None]:
        """A named range around the ``with`` block."""
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def _finished_active_steps(self) -> int:
        """Steps of the current cycle's active phase that ended with ``step()``."""
        assert self._profile is not None
        schedule = self.schedule
        cycle = schedule["wait"] + schedule["warmup"] + schedule["active"]
        position = (self._profile.step_num - schedule["skip_first"]) % cycle
        return max(0, position - schedule["wait"] - schedule["warmup"])

    def _close_ranges(self) -> None:
        while self._open:
            self._open.pop()[1].__exit__(None, None, None)

    def _write_trace(self, profile: torch.profiler.profile) -> None:
        if self._discard:
            return
        batch = self.first_step + profile.step_num
        path = self.folder / self.filename.format(rank=self.rank, batch=batch)
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(path))
        self.traces.append(path)
        if self.memory_filename is not None:
            import torch

            memory = self.folder / self.memory_filename.format(rank=self.rank, batch=batch)
            profile.export_memory_timeline(str(memory), device="cuda:0" if torch.cuda.is_available() else "cpu")
            self.traces.append(memory)

    def __enter__(self) -> TraceProfiler:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
