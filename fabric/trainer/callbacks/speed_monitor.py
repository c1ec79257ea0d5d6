"""``SpeedMonitor``: training throughput (batches, samples, tokens, FLOPs per second) and model FLOPs utilization."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from fabric.trainer.core.callback import Callback
from fabric.utilities.throughput import Throughput

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State
    from fabric.trainer.core.time import Timestamp

#: Throughput's global rates -> the names SpeedMonitor logs.
_LOGGED_NAMES = {
    "batches_per_sec": "throughput/batches_per_sec",
    "samples_per_sec": "throughput/samples_per_sec",
    "items_per_sec": "throughput/tokens_per_sec",
    "flops_per_sec": "throughput/flops_per_sec",
    "mfu": "throughput/mfu",
}


class SpeedMonitor(Callback):
    """Logs throughput at every ``BATCH_END``, averaged over the last ``window_size`` batches.

    Counts come from ``state.timestamp`` (global over ranks) and time from each batch's ``batch_wct``,
    so evaluation and data waits between batches do not dilute the rates. Logs
    ``throughput/batches_per_sec``, ``throughput/samples_per_sec``, ``throughput/tokens_per_sec``
    (when the batches had tokens) and ``time/train`` (``total_wct`` in seconds). Until ``window_size``
    batches have run, the average is over those there are. The rates are
    :class:`fabric.utilities.throughput.Throughput`'s, over the global counts.

    If the model has ``flops_per_batch(batch) -> float`` (FLOPs of one forward and backward of this
    rank's batch), ``throughput/flops_per_sec`` over all ranks is logged, plus
    ``throughput/mfu`` = FLOPs per second / (``flops_available_per_device`` * world size) when the
    device's peak FLOP/s is given.
    """

    def __init__(self, window_size: int = 100, flops_available_per_device: float | None = None) -> None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be a whole number of batches, at least 1; got {window_size!r}.")
        if flops_available_per_device is not None and not (
            isinstance(flops_available_per_device, int | float) and 0 < flops_available_per_device < math.inf
        ):
            raise ValueError(
                f"flops_available_per_device must be the device's peak FLOP/s (a positive number) or None; "
                f"got {flops_available_per_device!r}."
            )
        self.window_size = window_size
        self.flops_available_per_device = flops_available_per_device
        self._throughput: Throughput | None = None
        self._totals = (0.0, 0, 0, 0)  # batch seconds, batches, samples, tokens since the first batch
        self._batch_start: Timestamp | None = None
        self._counts_tokens = False

    def _start_counting(self, state: State, counts_tokens: bool) -> Throughput:
        """The window of totals, from zero; tokens are counted when the first batch had any.

        Counts are global, so the whole job is one "device" of world_size times the peak.
        """
        peak = self.flops_available_per_device
        available = None if peak is None else peak * _world_size(state)
        throughput = Throughput(available_flops=available, window_size=self.window_size)
        self._counts_tokens = counts_tokens
        throughput.update(time=0.0, batches=0, samples=0, lengths=0 if counts_tokens else None)
        return throughput

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        if self.flops_available_per_device is not None and _flops_per_batch(state) is None:
            raise ValueError(
                f"SpeedMonitor(flops_available_per_device=...) computes MFU from the model's FLOPs, but "
                f"{type(state.model).__name__} has no flops_per_batch(batch) method."
            )

    @override
    def batch_start(self, state: State, logger: Logger) -> None:
        self._batch_start = state.timestamp

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        now, before = state.timestamp, self._batch_start
        if before is None:
            raise RuntimeError("SpeedMonitor saw BATCH_END without BATCH_START, so it cannot count the batch.")
        seconds, batches, samples, tokens = self._totals
        seconds, batches, samples, tokens = self._totals = (
            seconds + now.batch_wct.total_seconds(),
            batches + 1,
            samples + int(now.sample) - int(before.sample),
            tokens + int(now.token) - int(before.token),
        )
        throughput = self._throughput
        if throughput is None:
            throughput = self._throughput = self._start_counting(state, counts_tokens=tokens > 0)
        lengths = tokens if self._counts_tokens else None
        throughput.update(time=seconds, batches=batches, samples=samples, lengths=lengths, flops=_global_flops(state))
        rates = throughput.compute()
        metrics = {"time/train": now.total_wct.total_seconds()}
        metrics.update({logged: rates[name] for name, logged in _LOGGED_NAMES.items() if name in rates})
        if not rates.get("items_per_sec"):  # the window's batches had no tokens
            metrics.pop("throughput/tokens_per_sec", None)
        logger.log_metrics(metrics)


def _flops_per_batch(state: State) -> Callable[[Any], float] | None:
    function = getattr(state.model, "flops_per_batch", None)  # a Fabric-wrapped model forwards the lookup
    return function if callable(function) else None


def _global_flops(state: State) -> float | None:
    """The FLOPs of this batch over all ranks, or None when the model does not count them.

    Like the trainer's sample count, this is this rank's count times the ranks whose batches differ (the
    strategy's ``batch_shares``): sharded loaders give every share an equally sized batch, and a collective per
    batch would cost more than it buys.
    """
    function = _flops_per_batch(state)
    shares = 1 if state.fabric is None else state.fabric.strategy.batch_shares
    return None if function is None else float(function(state.batch)) * shares


def _world_size(state: State) -> int:
    return 1 if state.fabric is None else int(state.fabric.world_size)
