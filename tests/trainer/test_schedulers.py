"""LR schedulers: multiplier tables worked out by hand from the documented formulas, and LRSchedule."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric.trainer.core.time import Time, Timestamp
from fabric.trainer.schedulers import (
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    CosineAnnealingWithWarmupScheduler,
    ExponentialScheduler,
    LinearScheduler,
    LinearWithWarmupScheduler,
    LRSchedule,
    MultiStepScheduler,
    MultiStepWithWarmupScheduler,
    PolynomialScheduler,
    PolynomialWithWarmupScheduler,
    Scheduler,
    StepScheduler,
)

PI = math.pi


@dataclass
class FakeState:
    """The attributes schedulers read; the trainer's State provides the same."""

    timestamp: Timestamp
    max_duration: Time[Any]
    dataloader_len: int | None = None


def state(
    batch: int = 0,
    epoch: int = 0,
    sample: int = 0,
    token: int = 0,
    max_duration: str = "10ba",
    dataloader_len: int | None = None,
) -> FakeState:
    return FakeState(
        Timestamp(epoch=epoch, batch=batch, sample=sample, token=token),
        Time.from_timestring(max_duration),
        dataloader_len,
    )


def half_cosine(tau: float, alpha_f: float = 0.0) -> float:
    return alpha_f + (1 - alpha_f) * (1 + math.cos(PI * tau)) / 2


# Each row: scheduler, the state, and the multiplier worked out by hand from the class docstring's formula.
TABLE: list[tuple[str, Scheduler, FakeState, float]] = [
    # StepScheduler: gamma ** floor(t / step_size)
    ("step b0", StepScheduler("3ba", gamma=0.5), state(batch=0), 1.0),
    ("step b2", StepScheduler("3ba", gamma=0.5), state(batch=2), 1.0),
    ("step b3", StepScheduler("3ba", gamma=0.5), state(batch=3), 0.5),
    ("step b5", StepScheduler("3ba", gamma=0.5), state(batch=5), 0.5),
    ("step b6", StepScheduler("3ba", gamma=0.5), state(batch=6), 0.25),
    ("step b9", StepScheduler("3ba", gamma=0.5), state(batch=9), 0.125),
    # Epochs count batches through the dataloader's length (4 here): 2ep is 8 batches.
    ("step ep1", StepScheduler("2ep"), state(epoch=1, batch=7, dataloader_len=4), 1.0),
    ("step ep2", StepScheduler("2ep"), state(epoch=2, batch=8, dataloader_len=4), 0.1),
    ("step ep4", StepScheduler("2ep"), state(epoch=4, batch=16, dataloader_len=4), 0.01),
    # 0.1dur of 30ba is 3 batches; at batch 9 (fraction 0.3) three steps are done despite float noise.
    ("step dur b8", StepScheduler("0.1dur", gamma=0.5), state(batch=8, max_duration="30ba"), 0.25),
    ("step dur b9", StepScheduler("0.1dur", gamma=0.5), state(batch=9, max_duration="30ba"), 0.125),
    # MultiStepScheduler: gamma ** (milestones reached)
    ("multistep b1", MultiStepScheduler(["2ba", "5ba"]), state(batch=1), 1.0),
    ("multistep b2", MultiStepScheduler(["2ba", "5ba"]), state(batch=2), 0.1),
    ("multistep b4", MultiStepScheduler(["2ba", "5ba"]), state(batch=4), 0.1),
    ("multistep b5", MultiStepScheduler(["2ba", "5ba"]), state(batch=5), 0.01),
    ("multistep b9", MultiStepScheduler(["2ba", "5ba"]), state(batch=9), 0.01),
    ("multistep mixed b2", MultiStepScheduler(["3ba", "1ep"], 0.5), state(batch=2, dataloader_len=4), 1.0),
    ("multistep mixed b3", MultiStepScheduler(["3ba", "1ep"], 0.5), state(batch=3, dataloader_len=4), 0.5),
    ("multistep mixed b4", MultiStepScheduler(["3ba", "1ep"], 0.5), state(epoch=1, batch=4, dataloader_len=4), 0.25),
    ("multistep dur b4", MultiStepScheduler(["0.5dur"]), state(batch=4), 1.0),
    ("multistep dur b5", MultiStepScheduler(["0.5dur"]), state(batch=5), 0.1),
    # ConstantScheduler: alpha before t_max, 1 from t_max on
    ("constant b0", ConstantScheduler(alpha=0.5, t_max="0.4dur"), state(batch=0), 0.5),
    ("constant b3", ConstantScheduler(alpha=0.5, t_max="0.4dur"), state(batch=3), 0.5),
    ("constant b4", ConstantScheduler(alpha=0.5, t_max="0.4dur"), state(batch=4), 1.0),
    ("constant b9", ConstantScheduler(alpha=0.5, t_max="0.4dur"), state(batch=9), 1.0),
    ("constant default", ConstantScheduler(), state(batch=5), 1.0),
    # LinearScheduler: alpha_i + (alpha_f - alpha_i) * min(1, t / t_max)
    ("linear b0", LinearScheduler(1.0, 0.2, "5ba"), state(batch=0), 1.0),
    ("linear b2", LinearScheduler(1.0, 0.2, "5ba"), state(batch=2), 1.0 - 0.8 * 2 / 5),
    ("linear b5", LinearScheduler(1.0, 0.2, "5ba"), state(batch=5), 0.2),
    ("linear b8", LinearScheduler(1.0, 0.2, "5ba"), state(batch=8), 0.2),
    ("linear default b3", LinearScheduler(), state(batch=3), 0.7),
    ("linear samples", LinearScheduler(t_max="100sp"), state(batch=1, sample=25), 0.75),
    ("linear tokens", LinearScheduler(0.0, 1.0, "1000tok"), state(batch=1, token=100), 0.1),
    ("linear zero t_max", LinearScheduler(1.0, 0.3, "0ba"), state(batch=0), 0.3),
    # ExponentialScheduler: gamma ** (t / decay_period)
    ("exponential b0", ExponentialScheduler(0.5, "4ba"), state(batch=0), 1.0),
    ("exponential b2", ExponentialScheduler(0.5, "4ba"), state(batch=2), math.sqrt(0.5)),
    ("exponential b4", ExponentialScheduler(0.5, "4ba"), state(batch=4), 0.5),
    ("exponential b10", ExponentialScheduler(0.5, "4ba"), state(batch=10), 0.5**2 * math.sqrt(0.5)),
    ("exponential default ep2", ExponentialScheduler(0.9), state(epoch=2, batch=20, dataloader_len=10), 0.81),
    ("exponential default b25", ExponentialScheduler(0.9), state(epoch=2, batch=25, dataloader_len=10), 0.9**2.5),
    # CosineAnnealingScheduler: alpha_f + (1 - alpha_f) * (1 + cos(pi * min(1, t / t_max))) / 2
    ("cosine b0", CosineAnnealingScheduler(alpha_f=0.1), state(batch=0), 1.0),
    ("cosine b3", CosineAnnealingScheduler(alpha_f=0.1), state(batch=3), 0.1 + 0.9 * (1 + math.cos(0.3 * PI)) / 2),
    ("cosine b5", CosineAnnealingScheduler(alpha_f=0.1), state(batch=5), 0.55),
    ("cosine b10", CosineAnnealingScheduler(alpha_f=0.1), state(batch=10), 0.1),
    ("cosine b12", CosineAnnealingScheduler(alpha_f=0.1), state(batch=12), 0.1),
    # 1dur of max_duration=2ep with 4 batches per epoch is 8 batches: the cosine moves every batch.
    (
        "cosine epochs b2",
        CosineAnnealingScheduler(),
        state(batch=2, max_duration="2ep", dataloader_len=4),
        0.5 + 0.5**1.5,
    ),
    (
        "cosine epochs b4",
        CosineAnnealingScheduler(),
        state(epoch=1, batch=4, max_duration="2ep", dataloader_len=4),
        0.5,
    ),
    # CosineAnnealingWarmRestartsScheduler, t_mult=1: intervals [0,4), [4,8), ...
    ("restarts b0", CosineAnnealingWarmRestartsScheduler("4ba"), state(batch=0), 1.0),
    ("restarts b2", CosineAnnealingWarmRestartsScheduler("4ba"), state(batch=2), 0.5),
    ("restarts b4", CosineAnnealingWarmRestartsScheduler("4ba"), state(batch=4), 1.0),
    ("restarts b5", CosineAnnealingWarmRestartsScheduler("4ba"), state(batch=5), (1 + math.cos(PI / 4)) / 2),
    ("restarts b6 alpha_f", CosineAnnealingWarmRestartsScheduler("4ba", alpha_f=0.2), state(batch=6), 0.6),
    # t_mult=2: intervals [0,4), [4,12), [12,28)
    ("restarts x2 b3", CosineAnnealingWarmRestartsScheduler("4ba", 2.0), state(batch=3), half_cosine(3 / 4)),
    ("restarts x2 b4", CosineAnnealingWarmRestartsScheduler("4ba", 2.0), state(batch=4), 1.0),
    ("restarts x2 b8", CosineAnnealingWarmRestartsScheduler("4ba", 2.0), state(batch=8), 0.5),
    ("restarts x2 b12", CosineAnnealingWarmRestartsScheduler("4ba", 2.0), state(batch=12), 1.0),
    ("restarts x2 b20", CosineAnnealingWarmRestartsScheduler("4ba", 2.0), state(batch=20), 0.5),
    # 0.1dur of 30ba: intervals of 3 batches; batch 9 starts the fourth one despite float noise.
    ("restarts dur b9", CosineAnnealingWarmRestartsScheduler("0.1dur"), state(batch=9, max_duration="30ba"), 1.0),
    (
        "restarts dur b10",
        CosineAnnealingWarmRestartsScheduler("0.1dur"),
        state(batch=10, max_duration="30ba"),
        half_cosine(1 / 3),
    ),
    # PolynomialScheduler: alpha_f + (1 - alpha_f) * (1 - min(1, t / t_max)) ** power
    ("poly b0", PolynomialScheduler(2.0, "10ba", alpha_f=0.1), state(batch=0), 1.0),
    ("poly b5", PolynomialScheduler(2.0, "10ba", alpha_f=0.1), state(batch=5), 0.1 + 0.9 * 0.25),
    ("poly b10", PolynomialScheduler(2.0, "10ba", alpha_f=0.1), state(batch=10), 0.1),
    ("poly sqrt b4", PolynomialScheduler(0.5), state(batch=4), math.sqrt(0.6)),
    # MultiStepWithWarmupScheduler: t / t_warmup before t_warmup, then gamma ** (milestones reached)
    ("ms warmup b0", MultiStepWithWarmupScheduler("4ba", ["6ba", "8ba"]), state(batch=0), 0.0),
    ("ms warmup b1", MultiStepWithWarmupScheduler("4ba", ["6ba", "8ba"]), state(batch=1), 0.25),
    ("ms warmup b3", MultiStepWithWarmupScheduler("4ba", ["6ba", "8ba"]), state(batch=3), 0.75),
    ("ms warmup b4", MultiStepWithWarmupScheduler("4ba", ["6ba", "8ba"]), state(batch=4), 1.0),
    ("ms warmup b5", MultiStepWithWarmupScheduler("4ba", ["6ba", "8ba"]), state(batch=5), 1.0),
    ("ms warmup b6", MultiStepWithWarmupScheduler("4ba", ["6ba", "8ba"]), state(batch=6), 0.1),
    ("ms warmup b8", MultiStepWithWarmupScheduler("4ba", ["6ba", "8ba"]), state(batch=8), 0.01),
    # ConstantWithWarmupScheduler: (t / t_warmup) * alpha, then alpha before t_max, then 1
    ("const warmup b0", ConstantWithWarmupScheduler("2ba", 0.5, "6ba"), state(batch=0), 0.0),
    ("const warmup b1", ConstantWithWarmupScheduler("2ba", 0.5, "6ba"), state(batch=1), 0.25),
    ("const warmup b2", ConstantWithWarmupScheduler("2ba", 0.5, "6ba"), state(batch=2), 0.5),
    ("const warmup b5", ConstantWithWarmupScheduler("2ba", 0.5, "6ba"), state(batch=5), 0.5),
    ("const warmup b6", ConstantWithWarmupScheduler("2ba", 0.5, "6ba"), state(batch=6), 1.0),
    # LinearWithWarmupScheduler: (t / t_warmup) * alpha_i, then alpha_i + (alpha_f - alpha_i) * tau_w,
    # tau_w = (t - t_warmup) / (t_max - t_warmup); here t_warmup = 2 and t_max = 1dur = 10 batches.
    ("linear warmup b0", LinearWithWarmupScheduler("2ba"), state(batch=0), 0.0),
    ("linear warmup b1", LinearWithWarmupScheduler("2ba"), state(batch=1), 0.5),
    ("linear warmup b2", LinearWithWarmupScheduler("2ba"), state(batch=2), 1.0),
    ("linear warmup b6", LinearWithWarmupScheduler("2ba"), state(batch=6), 1.0 - 4 / 8),
    ("linear warmup b8", LinearWithWarmupScheduler("2ba"), state(batch=8), 1.0 - 6 / 8),
    ("linear warmup b10", LinearWithWarmupScheduler("2ba"), state(batch=10), 0.0),
    ("linear warmup alpha_i b1", LinearWithWarmupScheduler("2ba", alpha_i=0.8), state(batch=1), 0.4),
    ("linear warmup alpha_i b2", LinearWithWarmupScheduler("2ba", alpha_i=0.8), state(batch=2), 0.8),
    ("linear warmup alpha_i b6", LinearWithWarmupScheduler("2ba", alpha_i=0.8), state(batch=6), 0.8 - 0.8 * 4 / 8),
    # 0.2dur of 20ba is a 4-batch warmup; tau_w at batch 12 is (12 - 4) / (20 - 4).
    (
        "linear warmup dur",
        LinearWithWarmupScheduler("0.2dur", 1.0, 0.5, "20ba"),
        state(batch=12, max_duration="20ba"),
        1.0 - 0.5 * 8 / 16,
    ),
    # CosineAnnealingWithWarmupScheduler: t / t_warmup, then alpha_f + (1 - alpha_f) * (1 + cos(pi * tau_w)) / 2
    ("cosine warmup b1", CosineAnnealingWithWarmupScheduler("2ba", "10ba"), state(batch=1), 0.5),
    ("cosine warmup b2", CosineAnnealingWithWarmupScheduler("2ba", "10ba"), state(batch=2), 1.0),
    ("cosine warmup b4", CosineAnnealingWithWarmupScheduler("2ba", "10ba"), state(batch=4), half_cosine(2 / 8)),
    ("cosine warmup b6", CosineAnnealingWithWarmupScheduler("2ba", "10ba"), state(batch=6), 0.5),
    ("cosine warmup b10", CosineAnnealingWithWarmupScheduler("2ba", "10ba"), state(batch=10), 0.0),
    ("cosine warmup mixed b4", CosineAnnealingWithWarmupScheduler("2ba"), state(batch=4), half_cosine(2 / 8)),
    (
        "cosine warmup alpha_f b6",
        CosineAnnealingWithWarmupScheduler("2ba", alpha_f=0.2),
        state(batch=6),
        0.2 + 0.8 * 0.5,
    ),
    # PolynomialWithWarmupScheduler: t / t_warmup, then alpha_f + (1 - alpha_f) * (1 - tau_w) ** power
    ("poly warmup b1", PolynomialWithWarmupScheduler("2ba"), state(batch=1), 0.5),
    ("poly warmup b2", PolynomialWithWarmupScheduler("2ba"), state(batch=2), 1.0),
    ("poly warmup b6", PolynomialWithWarmupScheduler("2ba"), state(batch=6), 0.25),
    ("poly warmup b8", PolynomialWithWarmupScheduler("2ba"), state(batch=8), (2 / 8) ** 2),
    ("poly warmup b10", PolynomialWithWarmupScheduler("2ba"), state(batch=10), 0.0),
    (
        "poly warmup cubic",
        PolynomialWithWarmupScheduler("10sp", 3.0, "50sp", 0.1),
        state(batch=3, sample=30),
        0.1 + 0.9 * (1 - 20 / 40) ** 3,
    ),
]


@pytest.mark.parametrize(
    ("scheduler", "current", "expected"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_multiplier_table(scheduler: Scheduler, current: FakeState, expected: float) -> None:
    assert scheduler(current) == pytest.approx(expected, abs=1e-12)


def test_every_scheduler_is_in_the_table() -> None:
    covered = {type(row[1]) for row in TABLE}
    assert covered == {
        StepScheduler,
        MultiStepScheduler,
        ConstantScheduler,
        LinearScheduler,
        ExponentialScheduler,
        CosineAnnealingScheduler,
        CosineAnnealingWarmRestartsScheduler,
        PolynomialScheduler,
        MultiStepWithWarmupScheduler,
        ConstantWithWarmupScheduler,
        LinearWithWarmupScheduler,
        CosineAnnealingWithWarmupScheduler,
        PolynomialWithWarmupScheduler,
    }


def test_accepts_time_objects() -> None:
    scheduler = StepScheduler(Time(3, "ba"), gamma=0.5)
    assert scheduler.step_size == Time(3, "ba")
    assert scheduler(state(batch=3)) == 0.5


def test_restarts_with_many_intervals_is_fast() -> None:
    # t_mult = 1 uses a closed form: a million intervals in one call, tau = 2/4 in the last one.
    scheduler = CosineAnnealingWarmRestartsScheduler("4ba")
    assert scheduler(state(batch=4_000_002)) == pytest.approx(0.5)


# --- construction errors ------------------------------------------------------------------------

BAD_STRINGS = ["10", "10 ba", "1.5ba", "-1ba", "10bb", "ba", "0.3 dur", ""]


@pytest.mark.parametrize("bad", BAD_STRINGS)
@pytest.mark.parametrize(
    ("build", "owner", "argument"),
    [
        (lambda t: StepScheduler(t), "StepScheduler", "step_size"),
        (lambda t: MultiStepScheduler(["2ba", t]), "MultiStepScheduler", "milestones[1]"),
        (lambda t: ConstantScheduler(t_max=t), "ConstantScheduler", "t_max"),
        (lambda t: LinearScheduler(t_max=t), "LinearScheduler", "t_max"),
        (lambda t: ExponentialScheduler(0.9, t), "ExponentialScheduler", "decay_period"),
        (lambda t: CosineAnnealingScheduler(t), "CosineAnnealingScheduler", "t_max"),
        (lambda t: CosineAnnealingWarmRestartsScheduler(t), "CosineAnnealingWarmRestartsScheduler", "t_0"),
        (lambda t: PolynomialScheduler(2.0, t), "PolynomialScheduler", "t_max"),
        (lambda t: MultiStepWithWarmupScheduler(t, ["5ba"]), "MultiStepWithWarmupScheduler", "t_warmup"),
        (lambda t: MultiStepWithWarmupScheduler("1ba", [t]), "MultiStepScheduler", "milestones[0]"),
        (lambda t: ConstantWithWarmupScheduler(t), "ConstantWithWarmupScheduler", "t_warmup"),
        (lambda t: ConstantWithWarmupScheduler("1ba", t_max=t), "ConstantScheduler", "t_max"),
        (lambda t: LinearWithWarmupScheduler(t), "LinearWithWarmupScheduler", "t_warmup"),
        (lambda t: LinearWithWarmupScheduler("1ba", t_max=t), "LinearWithWarmupScheduler", "t_max"),
        (lambda t: CosineAnnealingWithWarmupScheduler(t), "CosineAnnealingWithWarmupScheduler", "t_warmup"),
        (lambda t: CosineAnnealingWithWarmupScheduler("1ba", t), "CosineAnnealingWithWarmupScheduler", "t_max"),
        (lambda t: PolynomialWithWarmupScheduler(t), "PolynomialWithWarmupScheduler", "t_warmup"),
        (lambda t: PolynomialWithWarmupScheduler("1ba", t_max=t), "PolynomialWithWarmupScheduler", "t_max"),
    ],
)
def test_bad_time_string_is_rejected_at_construction(build: Any, owner: str, argument: str, bad: str) -> None:
    with pytest.raises(ValueError, match=rf"^{owner}: {re.escape(argument)}: Time string .* is not valid\. Accepted"):
        build(bad)


@pytest.mark.parametrize("bare", [10, 0.5, True, None])
def test_bare_numbers_have_no_unit(bare: object) -> None:
    with pytest.raises(TypeError, match=r"StepScheduler: step_size must be a Time or a time string .* has no unit"):
        StepScheduler(bare)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: StepScheduler("0ba"), "step_size must be positive"),
        (lambda: ExponentialScheduler(0.5, "0dur"), "decay_period must be positive"),
        (lambda: CosineAnnealingWarmRestartsScheduler("0ep"), "t_0 must be positive"),
        (lambda: CosineAnnealingWarmRestartsScheduler("4ba", t_mult=0.5), "t_mult must be a finite number >= 1"),
        (lambda: StepScheduler("1ba", gamma=-0.5), "gamma must be a finite number >= 0"),
        (lambda: CosineAnnealingScheduler(alpha_f=math.nan), "alpha_f must be a finite number"),
        (lambda: MultiStepScheduler([]), "milestones is empty"),
        (
            lambda: CosineAnnealingWithWarmupScheduler("10ba", "200sp"),
            r"t_warmup='10ba', t_max='200sp' must be in the same",
        ),
        (lambda: PolynomialWithWarmupScheduler("10sp", t_max="100tok"), "must be in the same unit"),
        # the decay would be empty: the learning rate would sit at alpha_f (0) for the rest of training
        (lambda: LinearWithWarmupScheduler("20ba", t_max="20ba"), r"\(t_warmup=20ba, t_max=20ba\): t_max must come"),
        (lambda: CosineAnnealingWithWarmupScheduler("0.5dur", t_max="0.2dur"), "t_max must come after t_warmup"),
        (lambda: PolynomialWithWarmupScheduler("3ep", t_max="2ep"), "t_max must come after t_warmup"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_a_warmup_that_reaches_t_max_only_on_the_clock_is_refused_at_the_first_batch() -> None:
    """'20ba' and '0.5dur' meet only once max_duration is known: with 30 batches, t_max is 15, inside the warmup,
    and the last 10 batches would train at alpha_f = 0."""
    scheduler = LinearWithWarmupScheduler("20ba", t_max="0.5dur")
    with pytest.raises(ValueError, match=r"t_warmup=20ba = 20, t_max=0.5dur = 15 with max_duration=30ba\): t_max"):
        scheduler(state(batch=0, max_duration="30ba"))
    assert scheduler(state(batch=30, max_duration="80ba")) == pytest.approx(1.0 - 10 / 20)
    assert scheduler(state(batch=5, max_duration="20ba")) == 0.25  # a run that ends with the warmup is fine
    assert LinearWithWarmupScheduler("20ba")(state(batch=5, max_duration="20ba")) == 0.25


def test_milestones_must_be_a_list() -> None:
    with pytest.raises(TypeError, match="milestones must be a list"):
        MultiStepScheduler("10ba")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gamma must be a number"):
        StepScheduler("1ba", gamma="0.1")  # type: ignore[arg-type]


def test_units_that_cannot_meet_fail_at_call() -> None:
    scheduler = CosineAnnealingWithWarmupScheduler("10sp", "1dur")  # 1dur of 2ep is batches; samples cannot mix
    with pytest.raises(ValueError, match=r"max_duration is 2ep: they count ba and sp"):
        scheduler(state(epoch=0, batch=3, max_duration="2ep", dataloader_len=4))


WARMUPS = [
    MultiStepWithWarmupScheduler("0.1dur", ["1ep"]),
    ConstantWithWarmupScheduler("0.1dur"),
    LinearWithWarmupScheduler("0.1dur"),
    CosineAnnealingWithWarmupScheduler("0.1dur"),
    PolynomialWithWarmupScheduler("0.1dur"),
]


@pytest.mark.parametrize("scheduler", WARMUPS)
def test_dur_warmup_of_an_epoch_based_run_counts_batches(scheduler: Scheduler) -> None:
    # 0.1dur of 2ep at 10 batches per epoch is 2 batches: batch 1 is half-way, batch 2 is done.
    assert scheduler(state(batch=1, max_duration="2ep", dataloader_len=10)) == pytest.approx(0.5)
    assert scheduler(state(batch=2, max_duration="2ep", dataloader_len=10)) == pytest.approx(1.0)


@pytest.mark.parametrize("scheduler", WARMUPS)
def test_epoch_based_times_without_a_dataloader_length_raise_naming_the_argument(scheduler: Scheduler) -> None:
    with pytest.raises(ValueError, match=r"t_warmup='0.1dur' counts an epoch max_duration, .* has none"):
        scheduler(state(batch=1, max_duration="2ep"))
    with pytest.raises(ValueError, match=r"StepScheduler: step_size='1ep' counts epochs"):
        StepScheduler("1ep")(state(batch=1, max_duration="20ba"))


def test_epoch_warmup_as_in_composer_docs() -> None:
    """``t_warmup="1ep"`` warms up over the first epoch's batches (10 here), one step per batch."""
    scheduler = CosineAnnealingWithWarmupScheduler(t_warmup="1ep", t_max="3ep")
    multipliers = [scheduler(state(batch=b, max_duration="3ep", dataloader_len=10)) for b in range(31)]
    assert multipliers[:11] == pytest.approx([b / 10 for b in range(10)] + [1.0])
    assert multipliers[20] == pytest.approx(0.5)  # half-way through the decay over batches [10, 30]
    assert multipliers[30] == pytest.approx(0.0)


def test_repr_shows_time_strings() -> None:
    assert repr(CosineAnnealingWithWarmupScheduler("2ba")) == (
        "CosineAnnealingWithWarmupScheduler(t_warmup='2ba', t_max='1.0dur', alpha_f=0.0, scale_warmup=False)"
    )
    assert repr(MultiStepScheduler(["2ba", "1ep"])) == "MultiStepScheduler(milestones=['2ba', '1ep'], gamma=0.1)"


# --- scale schedule ratio -----------------------------------------------------------------------


def test_ssr_scales_integer_unit_arguments() -> None:
    step = StepScheduler("4ba", gamma=0.5)
    assert step(state(batch=1), ssr=0.5) == 1.0
    assert step(state(batch=2), ssr=0.5) == 0.5  # step_size 4 * 0.5 = 2
    assert step(state(batch=4), ssr=0.5) == 0.25
    assert step(state(batch=7), ssr=2.0) == 1.0  # step_size 8
    assert step(state(batch=8), ssr=2.0) == 0.5

    cosine = CosineAnnealingScheduler("10ba")
    assert cosine(state(batch=5), ssr=0.5) == pytest.approx(0.0)  # t_max 5
    assert cosine(state(batch=3), ssr=0.5) == pytest.approx(half_cosine(3 / 5))
    assert cosine(state(batch=10), ssr=2.0) == pytest.approx(0.5)  # t_max 20


def test_ssr_scales_warmup_only_with_scale_warmup() -> None:
    scaled = LinearWithWarmupScheduler("4ba", t_max="12ba", scale_warmup=True)  # with ssr 0.5: warmup 2, t_max 6
    assert scaled(state(batch=1), ssr=0.5) == pytest.approx(0.5)
    assert scaled(state(batch=2), ssr=0.5) == pytest.approx(1.0)
    assert scaled(state(batch=4), ssr=0.5) == pytest.approx(1.0 - 2 / 4)
    kept = LinearWithWarmupScheduler("4ba", t_max="12ba")  # Composer's default: warmup stays 4, t_max becomes 6
    assert [kept(state(batch=b), ssr=0.5) for b in range(7)] == pytest.approx([0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.0])
    steps = MultiStepWithWarmupScheduler("4ba", ["8ba"])  # warmup 4 (kept), milestone 8 * 0.5 = 4
    assert [steps(state(batch=b), ssr=0.5) for b in range(6)] == pytest.approx([0, 0.25, 0.5, 0.75, 0.1, 0.1])
    constant = ConstantWithWarmupScheduler("4ba", alpha=0.5, t_max="8ba", scale_warmup=True)  # warmup 2, t_max 4
    assert [constant(state(batch=b), ssr=0.5) for b in range(5)] == pytest.approx([0, 0.25, 0.5, 0.5, 1.0])


def test_ssr_does_not_scale_dur_arguments() -> None:
    # dur is a fraction of max_duration, which the trainer scales itself; scaling here would apply ssr twice.
    cosine = CosineAnnealingScheduler("1dur")
    assert cosine(state(batch=5), ssr=0.5) == pytest.approx(0.5)
    mixed = CosineAnnealingWithWarmupScheduler("4ba", "1dur", scale_warmup=True)  # warmup 2, decay over [2, 10]
    assert mixed(state(batch=1), ssr=0.5) == pytest.approx(0.5)
    assert mixed(state(batch=6), ssr=0.5) == pytest.approx(half_cosine(4 / 8))


def test_ssr_boundaries_are_not_rounded_but_float_noise_is_snapped() -> None:
    step = StepScheduler("10ba", gamma=0.5)  # step_size 2.5 batches: steps take effect at batches 3, 5, 8
    assert [step(state(batch=b), ssr=0.25) for b in range(9)] == [1, 1, 1, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125]
    assert 25 * 0.28 > 7  # 7.000000000000001: a milestone at 7 batches must still be reached at batch 7
    assert MultiStepScheduler(["25ba"])(state(batch=7), ssr=0.28) == 0.1


@pytest.mark.parametrize("ssr", [0.0, -1.0, math.nan, math.inf])
def test_invalid_ssr(ssr: float) -> None:
    with pytest.raises(ValueError, match="scale schedule ratio"):
        StepScheduler("1ba")(state(), ssr=ssr)
    with pytest.raises(ValueError, match="scale schedule ratio"):
        LRSchedule([], [], scale_schedule_ratio=ssr)


# --- LRSchedule ---------------------------------------------------------------------------------


def sgd(*lrs: float) -> torch.optim.SGD:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def test_no_lag_batch_k_trains_with_multiplier_k() -> None:
    """At the start of batch k the lr is base_lr * m(k), and that lr is the one the optimizer step uses."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = LRSchedule(LinearWithWarmupScheduler("2ba", t_max="6ba"), optimizer)
    # By hand: warmup 0, 1/2; then 1 - (k - 2) / 4 for k in 2..6; 0 afterwards.
    expected = [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    current = state(max_duration="8ba")
    for k, multiplier in enumerate(expected):
        assert current.timestamp.batch == Time(k, "ba")
        assert schedule.apply(current) == pytest.approx(multiplier)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * multiplier)
        before = model.weight.detach().clone()
        model.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        assert model.weight.grad is not None
        update = -0.1 * multiplier * model.weight.grad
        optimizer.step()
        torch.testing.assert_close(model.weight.detach() - before, update)
        current = FakeState(current.timestamp.to_next_batch(samples=4), current.max_duration)


def test_schedulers_multiply_across_optimizers_and_groups() -> None:
    first, second = sgd(0.1, 0.01), sgd(1.0)
    schedule = LRSchedule([StepScheduler("2ba", 0.5), ConstantScheduler(0.1, "3ba")], [first, second])
    for batch, multiplier in [(0, 0.1), (1, 0.1), (2, 0.05), (3, 0.5), (4, 0.25)]:
        assert schedule.apply(state(batch=batch)) == pytest.approx(multiplier)
        lrs = [group["lr"] for optimizer in (first, second) for group in optimizer.param_groups]
        assert lrs == pytest.approx([0.1 * multiplier, 0.01 * multiplier, 1.0 * multiplier])
    assert schedule.multiplier(state(batch=2)) == pytest.approx(0.05)


def test_plain_functions_are_schedulers() -> None:
    optimizer = sgd(0.5)

    def halve_after_one_batch(current: Any, ssr: float = 1.0) -> float:
        return 0.5 if int(current.timestamp.batch) >= 1 else 1.0

    schedule = LRSchedule(halve_after_one_batch, optimizer)
    schedule.apply(state(batch=3))
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_initial_lr_is_recorded_once_per_group() -> None:
    optimizer = sgd(0.1, 0.2)
    schedule = LRSchedule(LinearScheduler(), optimizer)
    assert schedule.initial_lrs == [[0.1, 0.2]]
    for batch in range(6):
        schedule.apply(state(batch=batch))
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.05, 0.1])
    assert schedule.initial_lrs == [[0.1, 0.2]]  # the scaled lrs never became the base
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.4})
    schedule.apply(state(batch=6))
    assert schedule.initial_lrs == [[0.1, 0.2, 0.4]]
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.04, 0.08, 0.16])
    schedule.initial_lrs[0][0] = 99.0  # a copy
    assert schedule.initial_lrs == [[0.1, 0.2, 0.4]]


def test_state_dict_round_trip_resumes_exactly(tmp_path: Path) -> None:
    optimizer = sgd(0.1, 0.3)
    schedule = LRSchedule(CosineAnnealingScheduler(), optimizer)
    for batch in range(4):
        schedule.apply(state(batch=batch))
    path = tmp_path / "schedule.pt"
    torch.save({"schedule": schedule.state_dict(), "optimizer": optimizer.state_dict()}, path)

    loaded = torch.load(path, weights_only=True)
    assert loaded["schedule"] == {"initial_lrs": [[0.1, 0.3]]}
    resumed_optimizer = sgd(0.1, 0.3)
    resumed_optimizer.load_state_dict(loaded["optimizer"])  # lrs are now the scaled ones from batch 3
    resumed = LRSchedule(CosineAnnealingScheduler(), resumed_optimizer)
    assert resumed.initial_lrs != [[0.1, 0.3]]
    resumed.load_state_dict(loaded["schedule"])
    assert resumed.initial_lrs == [[0.1, 0.3]]
    resumed.apply(state(batch=4))
    schedule.apply(state(batch=4))
    assert [g["lr"] for g in resumed_optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * half_cosine(0.4))


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"initial_lrs": [[0.1], [0.2]]},  # two optimizers' worth
        {"initial_lrs": [[0.1, 0.2, 0.3]]},  # more groups than the optimizer has
        {"initial_lrs": [["0.1"]]},
        {"initial_lrs": [[math.nan]]},
        {"initial_lrs": "0.1"},
    ],
)
def test_load_state_dict_rejects_bad_state(bad: dict[str, Any]) -> None:
    schedule = LRSchedule(LinearScheduler(), sgd(0.1, 0.2))
    with pytest.raises(ValueError):
        schedule.load_state_dict(bad)
    assert schedule.initial_lrs == [[0.1, 0.2]]


def test_tensor_lr_is_updated_in_place() -> None:
    lr = torch.tensor(0.2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    LRSchedule(ConstantScheduler(0.5), optimizer).apply(state())
    assert optimizer.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(0.1)


def test_lr_schedule_refuses_torch_schedulers_and_bad_multipliers() -> None:
    optimizer = sgd(0.1)
    torch_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(TypeError, match="steps PyTorch LR schedulers itself"):
        LRSchedule([torch_scheduler], optimizer)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        LRSchedule([], [object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        LRSchedule(lambda current, ssr=1.0: -1.0, optimizer).apply(state())
