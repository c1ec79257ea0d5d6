"""``RuntimeEstimator``: how many seconds of training are left, from the pace so far."""

from __future__ import annotations

from typing import TYPE_CHECKING

from typing_extensions import override

from fabric.trainer.core.callback import Callback

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class RuntimeEstimator(Callback):
    """Logs ``time/remaining_estimate`` (seconds) at every ``BATCH_END``.

    The pace is the wall-clock time (``state.timestamp.total_wct``) per fraction of ``max_duration``
    since the end of the first ``skip_batches`` batches, which are left out because they are slow
    (warm-up, allocator growth, compilation). With ``max_duration`` in epochs and a dataloader of known
    length, progress counts batches within the epoch, so the estimate moves every batch.
    """

    def __init__(self, skip_batches: int = 1) -> None:
        if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"skip_batches must be a whole number of batches, at least 0; got {skip_batches!r}.")
        self.skip_batches = skip_batches
        self._batches_seen = 0
        self._start: tuple[float, float] | None = None  # (seconds, progress) when the measurement began

    @override
    def batch_start(self, state: State, logger: Logger) -> None:
        if self._batches_seen == self.skip_batches:
            self._start = (state.timestamp.total_wct.total_seconds(), _progress(state))

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        self._batches_seen += 1
        if self._start is None:
            return
        start_seconds, start_progress = self._start
        progress = _progress(state)
        if progress <= start_progress:
            return
        seconds_per_progress = (state.timestamp.total_wct.total_seconds() - start_seconds) / (progress - start_progress)
        logger.log_metrics({"time/remaining_estimate": seconds_per_progress * max(0.0, 1.0 - progress)})


def _progress(state: State) -> float:
    """The fraction of ``max_duration`` done (partial epochs count when the epoch length is known)."""
    return float(state.get_elapsed_duration())
