"""ClockCheck: a fit fails at once on a time its clock cannot reach, instead of never ending, evaluating or saving."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fabric.trainer.clock_check import ClockCheck
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, Timestamp
from fabric.trainer.intervals import IntervalFunction, create_interval
from fabric.trainer.schedulers import CosineAnnealingScheduler, LinearWithWarmupScheduler, LRSchedule

_NO_TOKENS = "but the first batch counted none"


def _state(max_duration: str, dataloader_len: int | None = 8) -> State:
    return State(model=nn.Linear(1, 1), max_duration=Time.from_timestring(max_duration), dataloader_len=dataloader_len)


def _schedule(*schedulers: object) -> LRSchedule:
    model = nn.Linear(1, 1)
    return LRSchedule(list(schedulers), [torch.optim.SGD(model.parameters(), lr=0.1)])


def _intervals(**named: str) -> list[tuple[str, IntervalFunction]]:
    return [(name, create_interval(interval, name=name)) for name, interval in named.items()]


def test_a_dur_interval_of_epochs_needs_the_dataloader_length() -> None:
    check = ClockCheck()
    check.start_fit(_state("2ep"), _intervals(save_interval="0.5dur"), None)
    with pytest.raises(ValueError, match=re.escape("save_interval='0.5dur' is a fraction of max_duration=2ep")):
        check.start_fit(_state("2ep", dataloader_len=None), _intervals(save_interval="0.5dur"), None)
    check.start_fit(_state("16ba", dataloader_len=None), _intervals(save_interval="0.5dur"), None)  # batches count


def test_a_schedule_that_cannot_be_measured_fails_naming_the_schedulers() -> None:
    check = ClockCheck()
    check.start_fit(_state("2ep"), [], _schedule(CosineAnnealingScheduler()))
    with pytest.raises(ValueError, match=r"^schedulers: CosineAnnealingScheduler: t_max='1.0dur' counts"):
        check.start_fit(_state("2ep", dataloader_len=None), [], _schedule(CosineAnnealingScheduler()))


def test_times_in_tokens_are_named_and_checked_after_the_first_batch() -> None:
    check = ClockCheck()
    schedule = _schedule(LinearWithWarmupScheduler(t_warmup="100tok", t_max="900tok"))
    check.start_fit(_state("1000tok"), _intervals(save_interval="50tok", eval_interval="1ep"), schedule)
    assert check.times_in_tokens == [
        "max_duration (1000tok)",
        "save_interval (every 50tok)",
        "LinearWithWarmupScheduler t_warmup='100tok'",
        "LinearWithWarmupScheduler t_max='900tok'",
    ]
    with pytest.raises(ValueError, match=re.escape(f"t_max='900tok' are in tokens, {_NO_TOKENS}, so they would")):
        check.check_tokens_counted(Timestamp().to_next_batch(4))
    check.check_tokens_counted(Timestamp().to_next_batch(4, tokens=40))
    assert check.times_in_tokens == []  # checked once per fit


def test_one_time_in_tokens_is_named_in_the_singular() -> None:
    check = ClockCheck()
    check.start_fit(_state("100tok"), [], None)
    with pytest.raises(ValueError, match=re.escape(f"max_duration (100tok) is in tokens, {_NO_TOKENS}, so it would")):
        check.check_tokens_counted(Timestamp().to_next_batch(4))


def test_a_fit_without_times_in_tokens_has_nothing_to_check() -> None:
    check = ClockCheck()
    check.start_fit(_state("100tok"), [], None)
    check.start_fit(_state("2ep"), _intervals(save_interval="1ep", eval_interval="0.5dur"), None)
    assert check.times_in_tokens == []  # the next fit replaces what the last one was waiting for
