"""``Profiler``: ``Trainer(profiler=...)`` runs ``torch.profiler`` on a batch schedule and marks the loop's phases.

As in Composer::

    from fabric.trainer.profiler import Profiler, cyclic_schedule

    trainer = Trainer(..., profiler=Profiler(schedule=cyclic_schedule(wait=1, warmup=1, active=3, repeat=1)))
    trainer.fit()   # writes {run_name}/torch_traces/rank{rank}.{batch}.pt.trace.json on every rank

The schedule counts the batches of each ``fit()`` call. Every rank writes its own Chrome trace (open
it in ``chrome://tracing`` or Perfetto) at the end of each active cycle; ``{batch}`` in the file name
is the batch count at that moment. Besides PyTorch's operators the trace shows the Trainer's phases
as ``user_annotation`` ranges, each between two events:

=========================  ===========================================
range                      from, to
=========================  ===========================================
``trainer/dataloader``     BEFORE_DATALOADER, AFTER_DATALOADER
``trainer/batch``          BATCH_START, BATCH_END
``trainer/train_batch``    BEFORE_TRAIN_BATCH, AFTER_TRAIN_BATCH
``trainer/forward``        BEFORE_FORWARD, AFTER_FORWARD (per microbatch)
``trainer/loss``           BEFORE_LOSS, AFTER_LOSS
``trainer/backward``       BEFORE_BACKWARD, AFTER_BACKWARD
``trainer/optimizer_step`` AFTER_TRAIN_BATCH, BATCH_END
``trainer/eval``           EVAL_BEFORE_ALL, EVAL_AFTER_ALL
``trainer/eval_batch``     EVAL_BATCH_START, EVAL_BATCH_END
``trainer/eval_forward``   EVAL_BEFORE_FORWARD, EVAL_AFTER_FORWARD
=========================  ===========================================

A range covers the algorithms and callbacks of its closing event, not those of its opening one.
For custom loops, :meth:`fabric.Fabric.profiler` gives the same schedule and traces without a Trainer.

``trace_handlers=[JSONTraceHandler(...)]`` also write these ranges as a trace of their own
(:mod:`fabric.trainer.trace_handlers`); ``torch_prof_memory_filename`` writes torch's memory timeline per cycle
(it needs the ``torch_prof_profile_memory``, ``_record_shapes`` and ``_with_stack`` options). As in Composer, the
torch trace folder must hold no earlier traces when the first ``fit()`` starts, unless ``torch_prof_overwrite=True``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.state import require_fabric
from fabric.trainer.trace_handlers import JSONTraceHandler, TraceHandler
from fabric.utilities.profiler import TraceProfiler, check_filename, check_memory_timeline, check_schedule

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

__all__ = ["CyclicSchedule", "JSONTraceHandler", "Profiler", "TraceHandler", "cyclic_schedule"]

#: Event -> (ranges to close, in order; ranges to open).
_RANGES: dict[Event, tuple[tuple[str, ...], tuple[str, ...]]] = {
    Event.BEFORE_DATALOADER: ((), ("dataloader",)),
    Event.AFTER_DATALOADER: (("dataloader",), ()),
    Event.BATCH_START: ((), ("batch",)),
    Event.BEFORE_TRAIN_BATCH: ((), ("train_batch",)),
    Event.BEFORE_FORWARD: ((), ("forward",)),
    Event.AFTER_FORWARD: (("forward",), ()),
    Event.BEFORE_LOSS: ((), ("loss",)),
    Event.AFTER_LOSS: (("loss",), ()),
    Event.BEFORE_BACKWARD: ((), ("backward",)),
    Event.AFTER_BACKWARD: (("backward",), ()),
    Event.AFTER_TRAIN_BATCH: (("train_batch",), ("optimizer_step",)),
    Event.BATCH_END: (("optimizer_step", "batch"), ()),
    Event.EVAL_BEFORE_ALL: ((), ("eval",)),
    Event.EVAL_BATCH_START: ((), ("eval_batch",)),
    Event.EVAL_BEFORE_FORWARD: ((), ("eval_forward",)),
    Event.EVAL_AFTER_FORWARD: (("eval_forward",), ()),
    Event.EVAL_BATCH_END: (("eval_batch",), ()),
    Event.EVAL_AFTER_ALL: (("eval",), ()),
}


@dataclass(frozen=True)
class CyclicSchedule:
    """Which batches to profile: skip ``skip_first``, then ``repeat`` cycles of wait, warmup and active batches."""

    skip_first: int = 0
    wait: int = 0
    warmup: int = 1
    active: int = 4
    repeat: int = 1


def cyclic_schedule(
    skip_first: int = 0, wait: int = 0, warmup: int = 1, active: int = 4, repeat: int = 1
) -> CyclicSchedule:
    """Composer's schedule: after ``skip_first`` batches, ``repeat`` cycles (0: every cycle until fit ends) of
    ``wait`` idle, ``warmup`` profiled-but-dropped and ``active`` recorded batches."""
    schedule = CyclicSchedule(skip_first, wait, warmup, active, repeat)
    check_schedule(asdict(schedule))
    return schedule


class Profiler(Callback):
    """Profiles the Trainer's batches with ``torch.profiler``; pass it as ``Trainer(profiler=...)``.

    ``torch_prof_folder`` may use ``{run_name}``; ``torch_prof_filename`` ``{rank}`` and ``{batch}``.
    The other ``torch_prof_*`` options are ``torch.profiler.profile``'s.
    """

    def __init__(
        self,
        schedule: CyclicSchedule | None = None,
        trace_handlers: TraceHandler | Sequence[TraceHandler] | None = None,
        *,
        torch_prof_folder: str = "{run_name}/torch_traces",
        torch_prof_filename: str = "rank{rank}.{batch}.pt.trace.json",
        torch_prof_record_shapes: bool = False,
        torch_prof_profile_memory: bool = False,
        torch_prof_with_stack: bool = False,
        torch_prof_with_flops: bool = False,
        torch_prof_memory_filename: str | None = None,
        torch_prof_overwrite: bool = False,
    ) -> None:
        if schedule is not None and not isinstance(schedule, CyclicSchedule):
            raise TypeError(
                f"schedule must come from fabric.trainer.profiler.cyclic_schedule(...), got {type(schedule).__name__}."
            )
        try:
            torch_prof_folder.format(run_name="run")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"torch_prof_folder={torch_prof_folder!r} may use only {{run_name}}: {error!r}") from None
        self.schedule = schedule or CyclicSchedule()
        self.folder = torch_prof_folder
        self._options: dict[str, Any] = {
            "filename": torch_prof_filename,
            "record_shapes": torch_prof_record_shapes,
            "profile_memory": torch_prof_profile_memory,
            "with_stack": torch_prof_with_stack,
            "with_flops": torch_prof_with_flops,
        }
        check_filename(torch_prof_filename)
        if torch_prof_memory_filename is not None:
            check_memory_timeline(
                torch_prof_memory_filename, torch_prof_profile_memory, torch_prof_record_shapes, torch_prof_with_stack
            )
        self._options["memory_filename"] = torch_prof_memory_filename
        handlers = [] if trace_handlers is None else trace_handlers
        self.trace_handlers = [handlers] if isinstance(handlers, TraceHandler) else list(handlers)
        for handler in self.trace_handlers:
            if not isinstance(handler, TraceHandler):
                raise TypeError(f"trace_handlers take TraceHandler objects (JSONTraceHandler), got {handler!r}.")
        self.overwrite = torch_prof_overwrite
        self._checked_folder = False
        self.run_name = "run"
        self.profiler: TraceProfiler | None = None
        #: Every trace written on this rank, over all fit() calls.
        self.traces: list[Any] = []

    def bind(self, run_name: str) -> None:
        """Called by the Trainer: the run name that fills ``{run_name}`` in the folder."""
        self.run_name = run_name

    @override
    def handlers(self) -> dict[Event, Callable[[State, Any], None]]:
        return {
            Event.FIT_START: self.fit_start,
            Event.FIT_END: self.fit_end,
            **{event: self._marker(event, *ranges) for event, ranges in _RANGES.items()},
        }

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        self.close()  # an earlier fit() that raised left its profiler running
        folder, rank = Path(self.folder.format(run_name=self.run_name)), require_fabric(state).global_rank
        if not self._checked_folder and not self.overwrite and folder.is_dir() and any(folder.iterdir()):
            raise FileExistsError(
                f"Profiler: {os.fspath(folder)!r} already holds traces; use another torch_prof_folder, empty it, or "
                "pass torch_prof_overwrite=True."
            )
        self._checked_folder = True
        for handler in self.trace_handlers:
            handler.start(self.run_name, rank)
        self.profiler = TraceProfiler(
            folder,
            rank=rank,
            first_step=int(state.timestamp.batch),
            **asdict(self.schedule),
            **self._options,
        )
        self.profiler.start()

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        self.close(state)
        for handler in self.trace_handlers:
            handler.fit_end(require_fabric(state).barrier)

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        """``Trainer.close()``: stop a profiler that a failed ``fit()`` left running (writing what it recorded)."""
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            written = len(profiler.traces)
            profiler.stop()
            self.traces.extend(profiler.traces)
            if len(profiler.traces) > written and state is not None:  # the cycle cut short was written
                self._cycle_ended(state)

    def _marker(self, event: Event, close: tuple[str, ...], open_: tuple[str, ...]) -> Callable[[State, Any], None]:
        names_to_close = tuple(f"trainer/{name}" for name in close)
        names_to_open = tuple(f"trainer/{name}" for name in open_)
        step = event is Event.BATCH_END

        def mark(state: State, logger: Logger) -> None:
            profiler = self.profiler
            if profiler is None:
                return
            if self.trace_handlers and profiler.recording:
                now = time.perf_counter_ns()
                for handler in self.trace_handlers:
                    for name in names_to_close:
                        handler.end(name, now)
                    for name in names_to_open:
                        handler.begin(name, now)
            for name in names_to_close:
                profiler.end(name)
            for name in names_to_open:
                profiler.begin(name)
            if step:
                written = len(profiler.traces)
                profiler.step()
                if len(profiler.traces) > written:  # a recorded cycle ended with this batch
                    self._cycle_ended(state)

        return mark

    def _cycle_ended(self, state: State) -> None:
        for handler in self.trace_handlers:
            handler.cycle_end(int(state.timestamp.epoch), int(state.timestamp.batch))
