"""Engine dispatch: algorithm order and undo nesting, callbacks only where overridden, State helpers."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from torch import nn

from fabric.trainer.algorithms.ema import EMA
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.engine import Engine
from fabric.trainer.core.events import Event
from fabric.trainer.core.passes import sort_to_front
from fabric.trainer.core.state import State, require_fabric
from fabric.trainer.core.time import Time, Timestamp


def _state(max_duration: str = "10ba") -> State:
    return State(model=nn.Linear(1, 1), max_duration=Time.from_timestring(max_duration))


class Scale(Algorithm):
    """Multiplies the batch before the forward and divides it back afterwards."""

    def __init__(self, factor: float, log: list[str]) -> None:
        self.factor, self.log = factor, log

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.BEFORE_FORWARD, Event.AFTER_FORWARD)

    def apply(self, event: Event, state: State, logger: Any) -> None:
        self.log.append(f"{self.factor}:{event.value}")
        state.batch = state.batch * self.factor if event == Event.BEFORE_FORWARD else state.batch / self.factor


class Shift(Scale):
    def apply(self, event: Event, state: State, logger: Any) -> None:
        self.log.append(f"+{self.factor}:{event.value}")
        state.batch = state.batch + self.factor if event == Event.BEFORE_FORWARD else state.batch - self.factor


def test_closing_events_run_algorithms_in_reverse_so_undo_nests() -> None:
    log: list[str] = []
    state = _state()
    state.batch = 3.0
    engine = Engine(state, logger=None, algorithms=[Scale(2.0, log), Shift(5.0, log)])
    engine.run_event(Event.BEFORE_FORWARD)
    assert state.batch == 11.0  # (3 * 2) + 5
    engine.run_event(Event.AFTER_FORWARD)
    assert state.batch == 3.0  # (11 - 5) / 2, exactly undone
    assert log == ["2.0:before_forward", "+5.0:before_forward", "+5.0:after_forward", "2.0:after_forward"]


def test_fire_runs_what_run_event_runs_and_nothing_for_an_event_nobody_listens_to() -> None:
    """``engine.fire.<event>()``, the per-batch path, dispatches exactly like ``run_event(event)``."""
    log: list[str] = []
    state = _state()
    state.batch = 3.0
    engine = Engine(state, logger=None, algorithms=[Scale(2.0, log), Shift(5.0, log)])
    engine.fire.before_forward()
    engine.fire.batch_end()  # nobody listens: the batch and the log stay as they are
    assert state.batch == 11.0
    engine.fire.after_forward()
    assert state.batch == 3.0
    assert log == ["2.0:before_forward", "+5.0:before_forward", "+5.0:after_forward", "2.0:after_forward"]


def test_a_custom_pass_reorders_algorithms() -> None:
    log: list[str] = []
    engine = Engine(_state(), None, algorithms=[Scale(2.0, log), Shift(1.0, log)], passes=[sort_to_front(Shift)])
    engine.state.batch = 1.0
    engine.run_event(Event.BEFORE_FORWARD)
    assert log == ["+1.0:before_forward", "2.0:before_forward"]


class Once(Algorithm):
    allow_multiple_instances = False

    def match(self, event: Event, state: State) -> bool:
        return False

    def apply(self, event: Event, state: State, logger: Any) -> None:
        raise AssertionError("never matched")


class Exclusive(Once):
    incompatible_with: ClassVar[tuple[type[Algorithm], ...]] = (Once,)


def test_two_instances_of_a_single_instance_algorithm_are_rejected() -> None:
    with pytest.raises(ValueError, match="Two Once instances were given; Once can run only once"):
        Engine(_state(), None, algorithms=[Once(), Once()])
    with pytest.raises(ValueError, match="Two EMA instances were given"):
        Engine(_state(), None, algorithms=[EMA(), EMA(half_life="10ba")])


def test_two_instances_of_an_algorithm_class_run_as_in_composer() -> None:
    """Composer runs both (two Scale settings here); the trainer checkpoints each under its own name."""
    log: list[str] = []
    state = _state()
    state.batch = 1.0
    engine = Engine(state, None, algorithms=[Scale(2.0, log), Scale(3.0, log)])
    engine.run_event(Event.BEFORE_FORWARD)
    assert log == ["2.0:before_forward", "3.0:before_forward"] and state.batch == 6.0


def test_incompatible_algorithms_are_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="Exclusive cannot run together with Once"):
        Engine(_state(), None, algorithms=[Once(), Exclusive()])


class Counter(Callback):
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def batch_end(self, state: State, logger: Any) -> None:
        self.calls.append(f"{self.name}:batch_end")


class Everything(Callback):
    def __init__(self) -> None:
        self.events: list[Event] = []

    def run_event(self, event: Event, state: State, logger: Any) -> None:
        self.events.append(event)


def test_callbacks_get_only_the_events_they_override_after_algorithms_and_before_loggers() -> None:
    calls: list[str] = []

    class Marker(Algorithm):
        def match(self, event: Event, state: State) -> bool:
            return event == Event.BATCH_END

        def apply(self, event: Event, state: State, logger: Any) -> None:
            calls.append("algorithm")

    engine = Engine(
        _state(),
        None,
        algorithms=[Marker()],
        callbacks=[Counter(calls, "callback")],
        loggers=[Counter(calls, "logger")],
    )
    assert set(Counter(calls, "x").handlers()) == {Event.BATCH_END}
    engine.run_event(Event.BATCH_START)
    engine.run_event(Event.BATCH_END)
    assert calls == ["algorithm", "callback:batch_end", "logger:batch_end"]


def test_overriding_run_event_receives_every_event() -> None:
    everything = Everything()
    engine = Engine(_state(), None, callbacks=[everything])
    for event in Event:
        engine.run_event(event)
    assert everything.events == list(Event)


def test_state_elapsed_duration_and_stop_training() -> None:
    state = _state("10ba")
    state.timestamp = Timestamp(batch=4, batch_in_epoch=4, sample=16, sample_in_epoch=16)
    assert state.get_elapsed_duration() == pytest.approx(0.4)
    assert not state.finished
    state.stop_training()
    assert state.finished and state.max_duration == Time.from_batch(4)


def test_require_fabric_says_what_is_missing() -> None:
    """Code that needs the Trainer's Fabric, run on a State made without one, names the cause."""
    state = _state()
    with pytest.raises(RuntimeError, match=r"state\.fabric is None"):
        require_fabric(state)
    fabric = object()
    state.fabric = fabric
    assert require_fabric(state) is fabric


def test_max_duration_in_dur_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot be in 'dur'"):
        _state("0.5dur")
