"""``InMemoryLogger``: keeps every logged value in Python lists, for tests and notebooks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import override

from fabric.trainer.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State
    from fabric.trainer.core.time import Timestamp

#: The counters of the run's clock that :meth:`InMemoryLogger.get_timeseries` gives beside a metric's values.
TIMESERIES_UNITS = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")


class InMemoryLogger(LoggerDestination):
    """Records metrics as ``data[name] = [(step, value), ...]``, the latest value of each name, and the latest table
    of each name as ``tables[name] = {"columns": [...], "rows": [[...], ...], "step": step}`` (Composer keeps a pandas
    JSON string there; ``pandas.DataFrame(table["rows"], columns=table["columns"])`` gives the same frame).

    Every rank keeps one (``all_ranks``), so a test can check what each process logged. Within a Trainer it also
    records the clock at each value, so :meth:`get_timeseries` can plot a metric against epochs, batches, samples
    or tokens, as Composer's does.
    """

    all_ranks: ClassVar[bool] = True

    def __init__(self) -> None:
        self.data: dict[str, list[tuple[int, float]]] = {}
        self.most_recent_values: dict[str, float] = {}
        self.hyperparameters: dict[str, Any] = {}
        self.tables: dict[str, dict[str, Any]] = {}
        self._state: State | None = None
        self._timestamps: dict[str, list[Timestamp | None]] = {}

    @override
    def init(self, state: State, logger: Logger) -> None:
        self._state = state

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        timestamp = None if self._state is None else self._state.timestamp  # immutable: a record, not a view
        for name, value in metrics.items():
            self.data.setdefault(name, []).append((step, value))
            self._timestamps.setdefault(name, []).append(timestamp)
            self.most_recent_values[name] = value

    @override
    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        self.hyperparameters.update(hyperparameters)

    @override
    def log_table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], name: str, step: int) -> None:
        self.tables[name] = {"columns": list(columns), "rows": [list(row) for row in rows], "step": step}

    def get_timeseries(self, metric: str) -> dict[str, list[Any]]:
        """``metric``'s values over time: ``{metric: [values], "step": [...], "epoch": [...], "batch": [...], ...}``,
        one list per counter of the clock (:data:`TIMESERIES_UNITS`; within a Trainer), aligned with the values,
        e.g. ``plt.plot(series["batch"], series["metrics/eval/Accuracy"])``."""
        if metric not in self.data:
            raise ValueError(f"No values of {metric!r} were logged; logged: {sorted(self.data)}.")
        series: dict[str, list[Any]] = {
            metric: [value for _, value in self.data[metric]],
            "step": [step for step, _ in self.data[metric]],
        }
        timestamps = self._timestamps[metric]
        if all(timestamp is not None for timestamp in timestamps):
            for unit in TIMESERIES_UNITS:
                series[unit] = [int(getattr(timestamp, unit)) for timestamp in timestamps]
        return series
