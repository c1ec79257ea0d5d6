"""``ThresholdStopper``: stop training once a metric crosses a threshold (accuracy above 0.95, loss below 0.1)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from typing_extensions import override

from fabric.trainer.callbacks.early_stopper import Comparator, MetricWatcher

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class ThresholdStopper(MetricWatcher):
    """Stop when ``comparator(metric, threshold)`` holds, after the current batch or at the end of its epoch.

    Args:
        monitor: Metric name, e.g. ``"accuracy"`` for ``state.metrics["metrics/eval/accuracy"]``.
        dataloader_label: The evaluator whose metric to watch, or ``"train"`` for the train metrics.
        threshold: The value to beat.
        comparator: ``comparator(metric, threshold)`` is true when the metric is good enough; default:
            ``<`` when ``"loss"`` is in ``monitor``, ``>`` otherwise.
        stop_on_batch: Stop right after the current batch instead of finishing the epoch.
    """

    def __init__(
        self,
        monitor: str,
        dataloader_label: str,
        threshold: float,
        comparator: Comparator | None = None,
        stop_on_batch: bool = False,
    ) -> None:
        super().__init__(monitor, dataloader_label, comparator)
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number, got {threshold!r}.")
        self.threshold = float(threshold)
        self.stop_on_batch = stop_on_batch
        self._stop_at_epoch_end = False

    @override
    def on_metric(self, state: State, value: float) -> None:
        if not self.is_better(value, self.threshold):
            return
        if self.stop_on_batch or _at_epoch_boundary(state):
            state.stop_training()
        else:
            self._stop_at_epoch_end = True

    @override
    def epoch_end(self, state: State, logger: Logger) -> None:
        if self._stop_at_epoch_end:
            state.stop_training()


def _at_epoch_boundary(state: State) -> bool:
    """Whether the current epoch has no batches left (evaluation at the end of an epoch)."""
    in_epoch = int(state.timestamp.batch_in_epoch)
    return in_epoch == 0 or in_epoch == state.dataloader_len
