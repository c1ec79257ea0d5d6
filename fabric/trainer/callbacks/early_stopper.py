"""``EarlyStopper``: stop training once a metric has not improved for ``patience``.

Also home of what the stoppers share: :class:`MetricWatcher` (which metric, when it is new, which
direction is better).
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.time import Time, Timestamp, TimeUnit

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

#: ``comparator(a, b)`` is true when ``a`` is better than ``b`` (``operator.lt``: lower is better).
Comparator = Callable[[float, float], Any]
TRAIN_LABEL = "train"


def _epochs_or_batches(name: str, value: int | str | Time[int]) -> Time[int]:
    """A positive interval in epochs or batches: ``"2ep"``, ``"100ba"``, a :class:`Time`, or an int meaning epochs."""
    accepted = "a positive number of epochs or batches, e.g. '1ep', '100ba', or an int meaning epochs"
    try:
        interval = Time.from_input(value, TimeUnit.EPOCH)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}={value!r} is not {accepted}: {error}") from None
    if interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or interval.value <= 0:
        raise ValueError(f"{name}={value!r} is not {accepted}.")
    return interval


class MetricWatcher(Callback, ABC):
    """Base of callbacks that act on ``state.metrics["metrics/<dataloader_label>/<monitor>"]`` when it is new.

    An evaluator's metrics are new when its evaluation ends (``EVAL_END`` with that ``dataloader_label``);
    the ``"train"`` label's metrics are new at every ``BATCH_END``. Without a ``comparator``, lower is
    better when ``"loss"`` is in ``monitor`` and higher otherwise.
    """

    def __init__(self, monitor: str, dataloader_label: str, comparator: Comparator | None) -> None:
        for name, value in (("monitor", monitor), ("dataloader_label", dataloader_label)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}.")
        self.monitor = monitor
        self.dataloader_label = dataloader_label
        self.metric_name = f"metrics/{dataloader_label}/{monitor}"
        if comparator is None:
            comparator = operator.lt if "loss" in monitor.lower() else operator.gt
        self.comparator = _checked_comparator(comparator)

    @abstractmethod
    def on_metric(self, state: State, value: float) -> None:
        """React to a newly computed value of the watched metric."""

    def is_better(self, value: float, reference: float) -> bool:
        return bool(self.comparator(value, reference))

    @override
    def eval_end(self, state: State, logger: Logger) -> None:
        if self.dataloader_label != TRAIN_LABEL and state.dataloader_label == self.dataloader_label:
            self.on_metric(state, self._read(state))

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        if self.dataloader_label == TRAIN_LABEL:
            self.on_metric(state, self._read(state))

    def _read(self, state: State) -> float:
        if self.metric_name not in state.metrics:
            raise ValueError(
                f"{type(self).__name__} monitors {self.metric_name!r}, which the {self.dataloader_label!r} metrics "
                f"do not include. Available: {sorted(state.metrics)}."
            )
        return float(state.metrics[self.metric_name])


def _checked_comparator(comparator: Comparator) -> Comparator:
    """``comparator`` if it takes two floats and answers something ``bool()`` accepts; a TypeError otherwise."""
    problem = "is not callable"
    if callable(comparator):
        try:
            bool(comparator(1.0, 0.0))
            return comparator
        except Exception as error:  # any failure on plain floats means it cannot compare metric values
            problem = f"fails on two floats ({type(error).__name__}: {error})"
    raise TypeError(
        f"comparator={comparator!r} {problem}; pass a function of two floats that is true when the first is "
        "better, e.g. operator.lt (lower is better) or operator.gt (higher is better)."
    )


class EarlyStopper(MetricWatcher):
    """Stop training when ``monitor`` has not improved by more than ``min_delta`` for ``patience``.

    Every time the metric is computed it is compared with the best value so far; training stops (after
    the current batch) at the first computation at which ``patience`` (``"2ep"``, ``"500ba"``, an int
    meaning epochs) or more has passed since the best one.

    Args:
        monitor: Metric name, e.g. ``"accuracy"`` for ``state.metrics["metrics/eval/accuracy"]``.
        dataloader_label: The evaluator whose metric to watch, or ``"train"`` for the train metrics.
        comparator: ``comparator(a, b)`` is true when ``a`` is better than ``b``; default: lower is better
            when ``"loss"`` is in ``monitor``, higher otherwise.
        min_delta: How much better than the best a value must be to count as an improvement.
        patience: How long the metric may go without improving.
    """

    def __init__(
        self,
        monitor: str,
        dataloader_label: str = "eval",
        comparator: Comparator | None = None,
        min_delta: float = 0.0,
        patience: int | str | Time[int] = "1ep",
    ) -> None:
        super().__init__(monitor, dataloader_label, comparator)
        if isinstance(min_delta, bool) or not isinstance(min_delta, int | float) or not 0 <= min_delta < math.inf:
            raise ValueError(f"min_delta must be a finite number >= 0, got {min_delta!r}.")
        self.min_delta = float(min_delta)
        self.patience = _epochs_or_batches("patience", patience)
        self.best: float | None = None
        self.best_at: Timestamp | None = None

    @override
    def on_metric(self, state: State, value: float) -> None:
        if self.best is None or self.best_at is None or self._improves(value, self.best):
            self.best, self.best_at = value, state.timestamp
            return
        unit = self.patience.unit
        if state.timestamp.get(unit) - self.best_at.get(unit) >= self.patience:
            state.stop_training()

    def _improves(self, value: float, best: float) -> bool:
        return self.is_better(value, best) and abs(value - best) > self.min_delta

    @override
    def state_dict(self) -> dict[str, Any]:
        """The best value and when it occurred, so a resumed run keeps counting patience from it."""
        if self.best is None or self.best_at is None:
            return {}
        return {"best": self.best, "best_at": self.best_at.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.best = float(state_dict["best"])
            self.best_at = Timestamp.from_state_dict(state_dict["best_at"])
