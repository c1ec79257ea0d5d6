"""``Logger``: the object algorithms and callbacks receive as ``logger``; it fans values out to destinations.

This is Composer's ``Logger`` (a facade, not a place values go); the destinations are
:class:`~fabric.trainer.loggers.destination.LoggerDestination` objects, with Fabric's own loggers
(:mod:`fabric.loggers`: CSV, TensorBoard, yours) adapted by
:class:`~fabric.trainer.loggers.fabric_logger.FabricLoggerDestination`. A Trainer's Fabric writes
through this facade too, so ``fabric.log(...)`` reaches the same destinations.

``logger.log_metrics({"lr": 0.1})`` stamps the values with the current batch count, turns tensors
into Python numbers once, and hands them to every destination. With no destination (the default for
benchmarks and most ranks) it returns before converting anything, so logging costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic

import torch
from typing_extensions import TypeVar

from fabric.loggers.logger import scalar

if TYPE_CHECKING:
    from fabric.trainer.core.state import State


class LogSink:
    """What a :class:`Logger` writes to: the logging half of a ``LoggerDestination`` (its other half, the
    event hooks, is ``Callback``'s). Kept apart from ``Callback`` so that the Logger, which every callback
    receives, does not depend on the callback module (that would be an import cycle)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar values (``{"loss/train/total": 0.25}``) at ``step`` (the global batch count)."""

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """Record the run's configuration once."""

    def log_table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], name: str, step: int) -> None:
        """Record a table (Composer's: e.g. the ``Generate`` callback's prompts and generations); a destination
        that cannot hold tables leaves it out, as in Composer."""

    def log_exception(self, exception: BaseException) -> None:
        """``fit()`` or ``eval()`` is ending with ``exception`` (Composer's name): a tracker marks its run failed
        (or killed, for ``KeyboardInterrupt``/``SystemExit``), so a crashed run never reads as finished."""


#: The kind of sink a Logger holds. Callbacks and algorithms see a plain ``Logger`` (of ``LogSink``s); the
#: Trainer's own is a ``Logger[LoggerDestination]``, whose destinations it also registers as callbacks.
SinkT = TypeVar("SinkT", bound=LogSink, default=LogSink, covariant=True)


class Logger(Generic[SinkT]):
    def __init__(self, state: State, destinations: Sequence[SinkT] = ()) -> None:
        self.state = state
        self.destinations: tuple[SinkT, ...] = tuple(destinations)

    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        """Send scalar ``metrics`` to every destination, at ``step`` (default: batches trained so far)."""
        if not self.destinations:
            return
        values = {name: float(scalar(name, value)) for name, value in metrics.items()}
        at = int(self.state.timestamp.batch) if step is None else step
        for destination in self.destinations:
            destination.log_metrics(values, at)

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        for destination in self.destinations:
            destination.log_hyperparameters(hyperparameters)

    def log_table(
        self, columns: Sequence[str], rows: Sequence[Sequence[Any]], name: str = "Table", step: int | None = None
    ) -> None:
        """Send a table (``columns`` and ``rows`` of as many values) to every destination, at ``step`` (default:
        batches trained so far); a row of another length is refused before any destination sees it."""
        columns, rows = list(columns), [list(row) for row in rows]
        wrong = [index for index, row in enumerate(rows) if len(row) != len(columns)]
        if wrong:
            raise ValueError(f"log_table({name!r}): rows {wrong} do not have the {len(columns)} columns {columns}.")
        at = int(self.state.timestamp.batch) if step is None else step
        for destination in self.destinations:
            destination.log_table(columns, rows, name, at)

    def log_exception(self, exception: BaseException) -> None:
        """Tell every destination that the run is ending with ``exception`` (before it propagates)."""
        for destination in self.destinations:
            destination.log_exception(exception)
