"""Intervals: when something periodic (evaluation, checkpointing) happens, as a ``(state, event) -> bool``.

Users write an interval as a Time (``"2ep"``, ``"500ba"``, ``"10000sp"``, ``"0.25dur"``), an int (in
the default unit, epochs), or their own callable. The loop asks the interval at ``BATCH_END`` and
``EPOCH_END``; a Time interval answers yes when its unit's counter reaches a multiple of it (epochs at
``EPOCH_END``, the others at ``BATCH_END``), and, with ``include_end_of_training``, when training ends.
It never answers yes twice for one batch count (the last batch of an epoch sees both events), so
every user of an interval (each evaluator, the checkpoint saver) needs its own: :func:`create_interval`
returns a new one per call.

A ``dur`` interval counts batches when ``max_duration`` is in epochs, through the train dataloader's
length as Composer does: ``"0.25dur"`` of ``"2ep"`` at 8 batches per epoch fires at batches 4, 8, 12
and 16. Without a length that cannot be done; :func:`check_interval` raises (the Trainer calls it at ``fit()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from typing_extensions import override

from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, TimeUnit

IntervalFunction = Callable[[State, Event], bool]
IntervalInput = str | int | Time[Any] | IntervalFunction


def create_interval(
    interval: IntervalInput, *, name: str = "interval", include_end_of_training: bool = True
) -> IntervalFunction:
    """Turn what a user wrote into a function of ``(state, event)``; bad input fails here, at construction."""
    if callable(interval) and not isinstance(interval, Time):
        return interval
    time = _parsed(interval, name)
    if time.value <= 0:
        raise ValueError(f"{name}={interval!r} must be positive.")
    if time.unit is TimeUnit.DURATION:
        return _DurationInterval(float(time.value), include_end_of_training, name)
    return _CountInterval(time.unit, int(time.value), include_end_of_training)


def create_interval_scheduler(
    interval: IntervalInput,
    include_end_of_training: bool = True,
    checkpoint_events: bool = True,
    final_events: set[Event] | None = None,
) -> IntervalFunction:
    """Composer's ``create_interval_scheduler``: as :func:`create_interval`, asked at every event. With
    ``checkpoint_events`` (the default) it answers yes at ``BATCH_CHECKPOINT``/``EPOCH_CHECKPOINT``, after the
    batch's or epoch's evaluation, as the Trainer's own saves do; otherwise at ``BATCH_END``/``EPOCH_END``. The end
    of training fires at the same two events; ``final_events`` may only name those."""
    as_end = {Event.BATCH_CHECKPOINT: Event.BATCH_END, Event.EPOCH_CHECKPOINT: Event.EPOCH_END}
    if not checkpoint_events:
        as_end = {Event.BATCH_END: Event.BATCH_END, Event.EPOCH_END: Event.EPOCH_END}
    if final_events is not None and set(final_events) != set(as_end):
        raise ValueError(
            f"create_interval_scheduler(final_events={final_events!r}): the end of training fires at "
            f"{sorted(event.name for event in as_end)} here; leave final_events as None."
        )
    ours = create_interval(interval, name="interval", include_end_of_training=include_end_of_training)

    def at_its_events(state: State, event: Event) -> bool:
        return event in as_end and ours(state, as_end[event])

    return at_its_events


def create_eval_interval(interval: IntervalInput, *, name: str = "eval_interval") -> IntervalFunction:
    """An evaluation interval: as :func:`create_interval`, except that a count of 0 or less (``0``, ``-1``,
    ``"0ep"``; not a ``dur`` fraction) means never during training, as in Composer, whose tutorials pass
    ``eval_interval=0`` and call ``Trainer.eval()`` themselves."""
    if isinstance(interval, int) and not isinstance(interval, bool) and interval <= 0:
        return _never
    if not callable(interval) or isinstance(interval, Time):
        time = _parsed(interval, name)
        if time.unit is not TimeUnit.DURATION and time.value <= 0:
            return _never
    return create_interval(interval, name=name)


def _parsed(interval: str | int | Time[Any], name: str) -> Time[Any]:
    try:
        return Time.from_input(interval, TimeUnit.EPOCH)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{name}={interval!r} is not an interval: use a time string ('1ep', '500ba', '0.25dur'), an int (epochs) "
            f"or a callable (state, event) -> bool. ({error})"
        ) from None


def _never(state: State, event: Event) -> bool:
    return False


def check_interval(interval: IntervalFunction, state: State) -> None:
    """Raise if ``interval`` cannot be measured in this run (a ``dur`` interval of epochs of unknown length)."""
    if isinstance(interval, _DurationInterval):
        interval.check(state)


def fires_once(interval: IntervalFunction) -> bool:
    """Whether ``interval`` surely fires once per fit: a fraction of the duration of 1 or more (at its end)."""
    return isinstance(interval, _DurationInterval) and interval.fraction >= 1


def counts_tokens(interval: IntervalFunction) -> bool:
    """Whether ``interval`` is a Time in tokens (it never fires if no tokens are counted)."""
    return isinstance(interval, _CountInterval) and interval.unit is TimeUnit.TOKEN


def _at_end_of_training(state: State, event: Event) -> bool:
    return event in (Event.BATCH_END, Event.EPOCH_END) and state.finished


class _Interval:
    """Fires when :meth:`_due` says so or training just ended, at most once per batch count.

    The once-per-batch rule stops a run whose last batch also ends an epoch from evaluating twice.
    """

    def __init__(self, include_end_of_training: bool) -> None:
        self.include_end_of_training = include_end_of_training
        self._fired_at_batch = -1

    def __call__(self, state: State, event: Event) -> bool:
        due = self._due(state, event)
        if not due and self.include_end_of_training:
            due = _at_end_of_training(state, event)
        batch = int(state.timestamp.batch)
        if not due or batch == self._fired_at_batch:
            return False
        self._fired_at_batch = batch
        return True

    def _due(self, state: State, event: Event) -> bool:
        raise NotImplementedError


class _CountInterval(_Interval):
    """Every ``every`` epochs (at EPOCH_END) or batches (at BATCH_END); samples/tokens when crossing a multiple."""

    def __init__(self, unit: TimeUnit, every: int, include_end_of_training: bool) -> None:
        super().__init__(include_end_of_training)
        self.unit, self.every = unit, every
        self.event = Event.EPOCH_END if unit is TimeUnit.EPOCH else Event.BATCH_END
        self._crossing = _Crossing() if unit in (TimeUnit.SAMPLE, TimeUnit.TOKEN) else None

    @override
    def _due(self, state: State, event: Event) -> bool:
        if event is not self.event:
            return False
        count = int(state.timestamp.get(self.unit))
        if self._crossing is None:  # epochs and batches advance by one, so a multiple is never skipped
            return count % self.every == 0
        return self._crossing.crossed(count // self.every, first_batch=int(state.timestamp.batch) == 1)

    def __repr__(self) -> str:
        return f"every {self.every}{self.unit.value}"


class _DurationInterval(_Interval):
    """At the first BATCH_END at or past each multiple of ``fraction`` of max_duration."""

    def __init__(self, fraction: float, include_end_of_training: bool, name: str) -> None:
        super().__init__(include_end_of_training)
        self.fraction, self.name = fraction, name
        self._crossing = _Crossing()

    def check(self, state: State) -> None:
        max_duration = state.max_duration
        if max_duration is not None and max_duration.unit is TimeUnit.EPOCH and not state.dataloader_len:
            raise ValueError(
                f"{self.name}='{self.fraction}dur' is a fraction of max_duration={max_duration}, counted in batches "
                "through the train dataloader's length, and the train dataloader has no length. Give "
                f"{self.name} in 'ep' or 'ba', or max_duration in 'ba', or give the dataset a __len__."
            )

    @override
    def _due(self, state: State, event: Event) -> bool:
        if event is not Event.BATCH_END:
            return False
        self.check(state)
        mark = int(float(state.get_elapsed_duration()) / self.fraction + 1e-9)
        return self._crossing.crossed(mark, first_batch=int(state.timestamp.batch) == 1)

    def __repr__(self) -> str:
        return f"every {self.fraction}dur"


class _Crossing:
    """Detects a counter passing into a new multiple between two calls (counters that jump by more than one).

    The first call of a fresh run compares with zero; the first call after a resume only records the mark.
    """

    def __init__(self) -> None:
        self._last_mark: int | None = None

    def crossed(self, mark: int, first_batch: bool) -> bool:
        previous = self._last_mark if self._last_mark is not None else (0 if first_batch else mark)
        self._last_mark = mark
        return mark > previous


class SavesAtIntervals(Callback):
    """A callback that writes something every ``interval``: :meth:`save` runs at ``BATCH_CHECKPOINT`` when the
    interval answers yes at ``BATCH_END``, and at ``EPOCH_CHECKPOINT`` when it answers yes at ``EPOCH_END`` (the
    Trainer's checkpoints, Hugging Face folders)."""

    interval: IntervalFunction

    def save(self, state: State) -> str:
        """Write now (on every rank); returns where."""
        raise NotImplementedError

    @override
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.interval(state, Event.BATCH_END):
            self.save(state)

    @override
    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.interval(state, Event.EPOCH_END):
            self.save(state)
