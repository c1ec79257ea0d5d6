"""The event vocabulary: names callbacks use, and which events close a pair."""

from __future__ import annotations

import pytest

from fabric.trainer.core.events import Event


@pytest.mark.parametrize(
    "event",
    [Event.AFTER_LOAD, Event.AFTER_FORWARD, Event.AFTER_TRAIN_BATCH, Event.BATCH_END, Event.EPOCH_END, Event.FIT_END,
     Event.EVAL_AFTER_FORWARD, Event.EVAL_END, Event.EVAL_AFTER_ALL, Event.PREDICT_BATCH_END, Event.PREDICT_END,
     Event.ITERATION_END, Event.EVAL_STANDALONE_END],
)  # fmt: skip
def test_closing_events(event: Event) -> None:
    assert event.is_after


@pytest.mark.parametrize(
    "event",
    [Event.INIT, Event.BEFORE_LOAD, Event.FIT_START, Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BATCH_CHECKPOINT,
     Event.EVAL_BEFORE_ALL, Event.EVAL_START, Event.PREDICT_BEFORE_FORWARD, Event.ITERATION_START,
     Event.ITERATION_CHECKPOINT, Event.EVAL_STANDALONE_START],
)  # fmt: skip
def test_opening_and_single_events(event: Event) -> None:
    assert not event.is_after


def test_callback_method_names_are_the_event_values() -> None:
    assert Event.BATCH_END.value == "batch_end"
    assert Event.BATCH_END == "batch_end" == Event.BATCH_END  # its value, as in Composer
    assert Event.BATCH_END == "BATCH_END" and Event.BATCH_END == "Batch_End"  # its name, in any case
    assert Event.BATCH_END != "batch_start" and Event.BATCH_END != Event.BATCH_START and Event.BATCH_END != 3
    assert {Event.BATCH_END: 1}[Event.BATCH_END] == 1
    assert Event.FIT_START.value == "fit_start"
    assert len({event.value for event in Event}) == len(Event)


def test_eval_and_predict_families() -> None:
    assert {event for event in Event if event.is_eval} == {
        Event.EVAL_BEFORE_ALL, Event.EVAL_START, Event.EVAL_BATCH_START, Event.EVAL_BEFORE_FORWARD,
        Event.EVAL_AFTER_FORWARD, Event.EVAL_BATCH_END, Event.EVAL_END, Event.EVAL_AFTER_ALL,
        Event.EVAL_STANDALONE_START, Event.EVAL_STANDALONE_END,
    }  # fmt: skip
    assert sum(event.is_predict for event in Event) == 6
