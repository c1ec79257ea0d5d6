"""The clock checks of a fit: every time it waits for must be able to come.

A ``dur`` time of an epoch ``max_duration`` is counted in batches through the train dataloader's length, and a
time in tokens moves only if the batches count tokens. A run missing either would never end, evaluate, save or
move its learning rate, so :class:`ClockCheck` fails instead: before training for what the dataloader's length
decides, after the first batch for tokens (only a batch tells whether tokens are counted).
"""

from __future__ import annotations

from collections.abc import Sequence

from fabric.trainer.core.state import State
from fabric.trainer.core.time import Timestamp, TimeUnit
from fabric.trainer.intervals import IntervalFunction, check_interval, counts_tokens
from fabric.trainer.schedulers import LRSchedule

__all__ = ["ClockCheck"]


class ClockCheck:
    """One Trainer's clock checks: :meth:`start_fit` before every fit, then :meth:`check_tokens_counted` after
    its first batch while :attr:`times_in_tokens` is not empty."""

    def __init__(self) -> None:
        #: The times in tokens, named as the user gave them, that the first batch of this fit must count tokens for.
        self.times_in_tokens: list[str] = []

    def start_fit(
        self, state: State, intervals: Sequence[tuple[str, IntervalFunction]], schedule: LRSchedule | None
    ) -> None:
        """Fail if a ``dur`` or epoch time of an interval or the schedule cannot be counted in batches (no dataloader
        length); note the times in tokens (``max_duration``, ``intervals`` given by name, the schedule's)."""
        for _, interval in intervals:
            check_interval(interval, state)
        duration = state.max_duration
        in_tokens = [f"max_duration ({duration})"] if duration is not None and duration.unit is TimeUnit.TOKEN else []
        in_tokens += [f"{name} ({interval!r})" for name, interval in intervals if counts_tokens(interval)]
        if schedule is not None:
            try:
                schedule.multiplier(state)
            except ValueError as error:
                raise ValueError(f"schedulers: {error}") from None
            in_tokens += schedule.times_in_tokens()
        self.times_in_tokens = in_tokens

    def check_tokens_counted(self, timestamp: Timestamp) -> None:
        """After the first batch of a fit: a time in tokens while no tokens are counted would never come (a run that
        never ends, an evaluation or checkpoint that never happens), so fail naming it; else nothing is left to check.
        """
        if int(timestamp.token) == 0:
            times = self.times_in_tokens
            raise ValueError(
                f"{', '.join(times)} {'is' if len(times) == 1 else 'are'} in tokens, but the first batch counted "
                f"none, so {'it' if len(times) == 1 else 'they'} would never come. Count tokens with "
                "Trainer(get_num_tokens_in_batch=...), DataSpec(get_num_tokens_in_batch=...) or a "
                "get_num_tokens_in_batch method of the model; or use ba, sp or ep."
            )
        self.times_in_tokens = []
