"""Time strings, Time arithmetic and the trainer's clock (Timestamp)."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric.trainer.core.time import Time, Timestamp, TimeUnit, batches_in_epoch, elapsed_fraction

ACCEPTED = (
    "Accepted: an integer followed by ep, ba, sp or tok (e.g. '10ep', '500ba'), "
    "or a number followed by dur (e.g. '0.3dur')."
)


# --- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timestring", "value", "unit"),
    [
        ("10ep", 10, TimeUnit.EPOCH),
        ("500ba", 500, TimeUnit.BATCH),
        ("2048sp", 2048, TimeUnit.SAMPLE),
        ("1000tok", 1000, TimeUnit.TOKEN),
        ("0.3dur", 0.3, TimeUnit.DURATION),
        ("1dur", 1.0, TimeUnit.DURATION),
        ("1.5dur", 1.5, TimeUnit.DURATION),
        ("0ep", 0, TimeUnit.EPOCH),
        ("007ba", 7, TimeUnit.BATCH),
        (" 10ep\n", 10, TimeUnit.EPOCH),
    ],
)
def test_from_timestring(timestring: str, value: float, unit: TimeUnit) -> None:
    time = Time.from_timestring(timestring)
    assert time.value == value
    assert time.unit is unit
    assert type(time.value) is (float if unit is TimeUnit.DURATION else int)


@pytest.mark.parametrize(
    "timestring",
    [
        "10xx",  # unknown unit
        "-1ep",  # negative
        "+1ep",  # signs are not accepted at all
        "1.5ep",  # fraction of an integer unit
        "1.0ba",
        "",
        "   ",
        "ep",  # no number
        "dur",
        "10",  # no unit
        "1e3ba",  # exponents
        "1e-3dur",
        "10 ep",  # inner whitespace
        "1_000ba",
        "0x10ba",
        "10ep10",
        "10ep5ba",
        ".5dur",  # dur needs digits on both sides of the point
        "1.dur",
        "-0.5dur",
        "infdur",
        "nandur",
        "\u0661\u0660ep",  # non-ASCII digits
    ],
)
def test_bad_timestrings_name_the_string_and_the_accepted_forms(timestring: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(f'Time string {timestring!r} is not valid. {ACCEPTED}')}$"):
        Time.from_timestring(timestring)


def test_bad_timestring_message_text() -> None:
    with pytest.raises(ValueError) as error:
        Time.from_timestring("10xx")
    assert str(error.value) == (
        "Time string '10xx' is not valid. Accepted: an integer followed by ep, ba, sp or tok "
        "(e.g. '10ep', '500ba'), or a number followed by dur (e.g. '0.3dur')."
    )


def test_from_timestring_needs_a_string() -> None:
    with pytest.raises(TypeError, match="Expected a time string such as '10ep', got int"):
        Time.from_timestring(10)  # type: ignore[arg-type]


def test_unit_constructors() -> None:
    assert Time.from_epoch(2) == Time(2, TimeUnit.EPOCH)
    assert Time.from_batch(3) == Time(3, "ba")
    assert Time.from_sample(4) == Time(4, TimeUnit.SAMPLE)
    assert Time.from_token(5) == Time(5, TimeUnit.TOKEN)
    assert Time.from_duration(0.5) == Time(0.5, TimeUnit.DURATION)
    assert type(Time.from_duration(1).value) is float


@pytest.mark.parametrize(
    ("value", "default_unit", "expected"),
    [
        (10, TimeUnit.EPOCH, Time(10, TimeUnit.EPOCH)),
        (10, TimeUnit.BATCH, Time(10, TimeUnit.BATCH)),
        (10, "sp", Time(10, TimeUnit.SAMPLE)),
        (1, TimeUnit.DURATION, Time(1.0, TimeUnit.DURATION)),
        (0.25, TimeUnit.DURATION, Time(0.25, TimeUnit.DURATION)),
        ("500ba", TimeUnit.EPOCH, Time(500, TimeUnit.BATCH)),  # a string carries its own unit
        ("0.3dur", TimeUnit.TOKEN, Time(0.3, TimeUnit.DURATION)),
        (Time(7, TimeUnit.TOKEN), TimeUnit.EPOCH, Time(7, TimeUnit.TOKEN)),
    ],
)
def test_from_input(value: Any, default_unit: TimeUnit | str, expected: Time[Any]) -> None:
    assert Time.from_input(value, default_unit) == expected


def test_from_input_defaults_to_epochs_and_returns_times_unchanged() -> None:
    assert Time.from_input(3) == Time(3, TimeUnit.EPOCH)
    count: Any = torch.tensor(3)  # integer-like numbers count in the default unit too
    assert Time.from_input(count, TimeUnit.BATCH) == Time(3, TimeUnit.BATCH)
    time = Time(3, TimeUnit.BATCH)
    assert Time.from_input(time) is time


@pytest.mark.parametrize(
    ("value", "default_unit", "error", "message"),
    [
        (1.5, TimeUnit.EPOCH, TypeError, "A Time in 'ep' needs an integer, got 1.5."),
        (True, TimeUnit.EPOCH, TypeError, "Expected a Time, a time string such as '10ep' or a number, got True (bool)"),
        (None, TimeUnit.EPOCH, TypeError, "Expected a Time, a time string such as '10ep' or a number, got None (None"),
        (-1, TimeUnit.BATCH, ValueError, "A Time cannot be negative, got -1 ('ba')."),
        ("10", TimeUnit.BATCH, ValueError, "Time string '10' is not valid."),
        (10, "xx", ValueError, "Unknown time unit 'xx'; expected one of 'ep', 'ba', 'sp', 'tok', 'dur'."),
        ([10], TimeUnit.EPOCH, TypeError, "Expected a Time, a time string such as '10ep' or a number, got [10] (list)"),
    ],
)
def test_from_input_errors(value: Any, default_unit: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Time.from_input(value, default_unit)


@pytest.mark.parametrize(
    ("value", "unit", "error", "message"),
    [
        (-1, TimeUnit.EPOCH, ValueError, "A Time cannot be negative, got -1 ('ep')."),
        (-0.5, TimeUnit.DURATION, ValueError, "A Time cannot be negative, got -0.5 ('dur')."),
        (2.0, TimeUnit.BATCH, TypeError, "A Time in 'ba' needs an integer, got 2.0."),
        (True, TimeUnit.BATCH, TypeError, "A Time value must be a number, got True (bool)."),
        ("3", TimeUnit.BATCH, TypeError, "A Time value must be a number, got '3' (str)."),
        (float("inf"), TimeUnit.DURATION, ValueError, "A Time in 'dur' must be finite, got inf."),
        (float("nan"), TimeUnit.DURATION, ValueError, "A Time in 'dur' must be finite, got nan."),
        (3, "epochs", ValueError, "Unknown time unit 'epochs'"),
    ],
)
def test_constructor_errors(value: Any, unit: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Time(value, unit)


def test_constructor_accepts_integer_like_values() -> None:
    count: Any = torch.tensor(4)  # e.g. a count computed with torch
    time = Time(count, TimeUnit.BATCH)
    assert time == Time(4, TimeUnit.BATCH)
    assert type(time.value) is int
    assert Time(1, "dur").value == 1.0


# --- arithmetic and comparison ------------------------------------------------------------------


def test_arithmetic_within_one_unit() -> None:
    ba = Time.from_batch
    assert ba(10) + ba(5) == ba(15)
    assert ba(10) - ba(4) == ba(6)
    assert ba(10) - ba(10) == ba(0)
    assert ba(10) * 3 == ba(30)
    assert 3 * ba(10) == ba(30)
    assert ba(30) * 0.1 == ba(3)  # whole up to float noise (30 * 0.1 == 3.0000000000000004)
    assert ba(100) * 0.29 == ba(29)  # 28.999999999999996
    assert ba(10) / 2 == ba(5)
    assert ba(10) / 2.5 == ba(4)
    assert ba(10) / ba(4) == 2.5
    assert type(ba(10) / ba(5)) is float
    assert Time(10**18 + 2, "tok") / 2 == Time(5 * 10**17 + 1, "tok")  # exact beyond float precision
    dur = Time.from_duration
    assert dur(0.25) + dur(0.5) == dur(0.75)
    assert dur(0.75) - dur(0.5) == dur(0.25)
    assert dur(0.5) * 3 == dur(1.5)
    assert dur(0.5) / 4 == dur(0.125)
    assert dur(0.5) / dur(0.25) == 2.0
    assert isinstance(ba(1) * 2, Time)


@pytest.mark.parametrize(
    ("operation", "message"),
    [
        (lambda: Time.from_batch(10) / 3, "10ba / 3 = 3.3333333333333335 is not a whole number of 'ba'"),
        (lambda: Time.from_epoch(3) * 0.5, "3ep * 0.5 = 1.5 is not a whole number of 'ep'; round it explicitly"),
        (lambda: Time.from_batch(3) * float("inf"), "3ba * inf = inf is not a whole number of 'ba'"),
        # The float quotient 5e17 looks whole; the exact integer division knows there is a remainder.
        (lambda: Time.from_token(10**18 + 1) / 2, "1000000000000000001tok / 2 = 5e+17 is not a whole number of 'tok'"),
    ],
)
def test_scaling_an_integer_unit_must_give_a_whole_count(operation: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        operation()


def test_unit_case_is_ignored_as_in_composer() -> None:
    assert Time.from_timestring("10EP") == Time.from_epoch(10)
    assert Time.from_timestring(" 500Ba ") == Time.from_batch(500)
    assert Time.from_timestring("0.3DUR") == Time(0.3, "dur")
    assert Time.from_timestring("64TOK") == Time(64, "tok") and Time.from_epoch(2) == "2EP"


def test_remainder_within_one_unit() -> None:
    assert Time.from_batch(10) % 4 == Time.from_batch(2)
    assert Time.from_batch(10) % "5ba" == Time.from_batch(0)
    assert (Time(0.7, "dur") % 0.25).value == pytest.approx(0.2)
    with pytest.raises(TypeError, match="Cannot take the remainder of 10ba and 3ep"):
        Time.from_batch(10) % Time.from_epoch(3)
    with pytest.raises(ZeroDivisionError, match="10ba % 0ba: the divisor is zero"):
        Time.from_batch(10) % 0


def test_times_are_never_negative() -> None:
    assert +Time.from_batch(3) == Time.from_batch(3) and -Time.from_batch(0) == Time.from_batch(0)
    with pytest.raises(ValueError, match=re.escape("-3ba would be negative; a Time cannot be negative. Subtract")):
        -Time.from_batch(3)
    with pytest.raises(ValueError, match=re.escape("1ba - 2ba would be negative; a Time cannot be negative.")):
        Time.from_batch(1) - Time.from_batch(2)
    with pytest.raises(ValueError, match="A Time cannot be negative"):
        Time.from_batch(1) * -1
    with pytest.raises(ZeroDivisionError):
        Time.from_batch(1) / 0


@pytest.mark.parametrize(
    ("operation", "verb"),
    [
        (lambda a, b: a + b, "add"),
        (lambda a, b: a - b, "subtract"),
        (lambda a, b: a / b, "divide"),
        (lambda a, b: a < b, "compare"),
        (lambda a, b: a <= b, "compare"),
        (lambda a, b: a > b, "compare"),
        (lambda a, b: a >= b, "compare"),
    ],
)
def test_mixing_units_is_a_type_error_naming_both(operation: Any, verb: str) -> None:
    message = f"Cannot {verb} 10ba and 1ep: the units differ ('ba' and 'ep')."
    with pytest.raises(TypeError, match=re.escape(message)):
        operation(Time.from_batch(10), Time.from_epoch(1))


@pytest.mark.parametrize(
    "operation",
    [
        lambda t: t + None,
        lambda t: t - True,
        lambda t: t * t,
        lambda t: t * "2",
        lambda t: t * True,
        lambda t: t / "2",
        lambda t: t < None,
        lambda t: t >= "3ep",  # another unit: refused, not guessed
        lambda t: t + "1ep",
    ],
)
def test_operations_with_non_times_are_type_errors(operation: Any) -> None:
    with pytest.raises(TypeError):
        operation(Time.from_batch(3))


def test_comparisons_within_one_unit() -> None:
    ba = Time.from_batch
    assert ba(1) < ba(2) <= ba(2) < ba(3)
    assert ba(3) > ba(2) >= ba(2)
    assert not ba(2) < ba(2)
    assert Time.from_duration(0.3) < Time.from_duration(0.5)
    assert max(ba(3), ba(7), ba(5)) == ba(7)
    assert sorted([ba(3), ba(1), ba(2)]) == [ba(1), ba(2), ba(3)]


def test_equality_with_times_numbers_and_time_strings_as_in_composer() -> None:
    assert Time(3, TimeUnit.EPOCH) == Time.from_timestring("3ep")
    assert Time(3, TimeUnit.EPOCH) != Time(3, TimeUnit.BATCH)  # different units are different values, not an error
    assert Time(5, "ba") == 5
    assert 5 == Time(5, "ba")  # noqa: SIM300 -- the reflected side
    assert Time(5, "ba") != 6
    assert Time(3, TimeUnit.EPOCH) == "3ep"
    assert Time(3, TimeUnit.EPOCH) != "3ba"
    assert Time(3, TimeUnit.EPOCH) != "not a time"
    assert Time(1.0, TimeUnit.DURATION) == Time(1, TimeUnit.DURATION)
    assert Time(0.5, "dur") == 0.5
    assert Time(1, "ba") != True  # noqa: E712 -- a bool is not a count
    lookup: dict[object, str] = {Time(5, "ba"): "found"}
    assert lookup[5] == "found"  # equal values hash alike


def test_ordering_and_arithmetic_with_numbers_and_time_strings_as_in_composer() -> None:
    batch = Time(41, "ba")
    assert batch < 42 and batch <= 41 and not batch > 41 and batch >= 41.0
    assert 42 > batch and 40 < batch  # noqa: SIM300 -- the reflected side
    assert batch < "42ba" and "40ba" < batch  # noqa: SIM300 -- the reflected side
    assert Time(0.3, "dur") < 0.5 and Time(0.3, "dur") >= "0.3dur"
    assert batch + 1 == Time(42, "ba") and 1 + batch == Time(42, "ba")
    assert batch - "1ba" == Time(40, "ba") and 50 - batch == Time(9, "ba")
    with pytest.raises(ValueError, match="would be negative"):
        _ = 40 - batch
    with pytest.raises(TypeError, match="needs an integer"):
        _ = batch + 0.5
    with pytest.raises(ValueError, match="not valid"):
        _ = batch < "42 batches"


def test_timestamp_counters_compare_with_ints_and_the_timestamp_with_time_strings() -> None:
    timestamp = Timestamp(epoch=1, batch=41)
    assert timestamp.batch < 42 and timestamp.epoch == 1
    assert timestamp >= "41ba" and timestamp < "2ep"
    with pytest.raises(TypeError):
        _ = timestamp < 42  # type: ignore[operator]  # a bare number names no counter


# --- conversions and the value-object protocol --------------------------------------------------


def test_str_int_float_repr() -> None:
    assert str(Time(10, TimeUnit.EPOCH)) == "10ep"
    assert str(Time(500, TimeUnit.BATCH)) == "500ba"
    assert str(Time(2048, TimeUnit.SAMPLE)) == "2048sp"
    assert str(Time(1000, TimeUnit.TOKEN)) == "1000tok"
    assert str(Time(0.3, TimeUnit.DURATION)) == "0.3dur"
    assert str(Time(1, TimeUnit.DURATION)) == "1.0dur"
    assert int(Time(10, TimeUnit.EPOCH)) == 10
    assert float(Time(10, TimeUnit.EPOCH)) == 10.0
    assert float(Time(0.3, TimeUnit.DURATION)) == 0.3
    assert repr(Time(10, TimeUnit.EPOCH)) == "Time(10, TimeUnit.EPOCH)"
    assert repr(Time(0.3, TimeUnit.DURATION)) == "Time(0.3, TimeUnit.DURATION)"
    with pytest.raises(TypeError, match=re.escape("int() of 0.5dur would drop the fraction; use float().")):
        int(Time(0.5, TimeUnit.DURATION))


@pytest.mark.parametrize("value", [0.3, 0.1 + 0.2, 1e-5, 5e-324, 1e20, 1.0, 2.5, 0.0])
def test_str_of_dur_round_trips_through_parsing(value: float) -> None:
    time = Time.from_duration(value)
    assert "e" not in str(time)[:-3]
    assert Time.from_timestring(str(time)) == time


@pytest.mark.parametrize("timestring", ["10ep", "500ba", "2048sp", "1000tok", "0ep"])
def test_str_of_integer_units_round_trips_through_parsing(timestring: str) -> None:
    assert str(Time.from_timestring(timestring)) == timestring


def test_hash_and_immutability() -> None:
    time = Time(3, TimeUnit.EPOCH)
    assert hash(time) == hash(Time.from_timestring("3ep"))
    assert {time: "a"}[Time.from_epoch(3)] == "a"
    assert len({Time(3, TimeUnit.EPOCH), Time(3, TimeUnit.BATCH), Time.from_epoch(3)}) == 2
    with pytest.raises(AttributeError, match="Time is immutable"):
        time.value = 4  # type: ignore[misc]
    with pytest.raises(AttributeError, match="Time is immutable"):
        time._value = 4
    with pytest.raises(AttributeError, match="Time is immutable"):
        del time._unit
    with pytest.raises(AttributeError):
        time.other = 1
    assert time == Time(3, TimeUnit.EPOCH)
    total = Time.from_batch(1)
    total += Time.from_batch(2)  # rebinds the name; the original is untouched
    assert total == Time.from_batch(3)


@pytest.mark.parametrize("time", [Time(3, TimeUnit.EPOCH), Time(0.25, TimeUnit.DURATION)])
def test_times_pickle_and_copy(time: Time[Any]) -> None:
    assert pickle.loads(pickle.dumps(time)) == time
    assert copy.copy(time) == time
    assert copy.deepcopy(time) == time


# --- Timestamp ----------------------------------------------------------------------------------


def _counts(timestamp: Timestamp) -> dict[str, int]:
    names = ["epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch"]
    return {name: int(getattr(timestamp, name)) for name in names}


def test_a_new_timestamp_is_zero_in_every_unit() -> None:
    timestamp = Timestamp()
    assert _counts(timestamp) == dict.fromkeys(_counts(timestamp), 0)
    assert timestamp.total_wct == timestamp.epoch_wct == timestamp.batch_wct == timedelta(0)
    assert timestamp.epoch == Time.from_epoch(0)
    assert timestamp.batch_in_epoch == Time.from_batch(0)
    assert timestamp.sample_in_epoch == Time.from_sample(0)
    assert timestamp.token_in_epoch == Time.from_token(0)


def test_timestamp_counts_over_an_epoch_boundary() -> None:
    second = timedelta(seconds=1)
    timestamp = Timestamp()
    timestamp = timestamp.to_next_batch(8, tokens=80, duration=second)
    timestamp = timestamp.to_next_batch(8, tokens=80, duration=2 * second)
    assert _counts(timestamp) == {
        "epoch": 0,
        "batch": 2,
        "sample": 16,
        "token": 160,
        "batch_in_epoch": 2,
        "sample_in_epoch": 16,
        "token_in_epoch": 160,
    }
    assert (timestamp.total_wct, timestamp.epoch_wct, timestamp.batch_wct) == (3 * second, 3 * second, 2 * second)

    timestamp = timestamp.to_next_batch(4, tokens=40, duration=second)  # a short last batch
    timestamp = timestamp.to_next_epoch(duration=5 * second)  # e.g. evaluation after the epoch
    assert _counts(timestamp) == {
        "epoch": 1,
        "batch": 3,
        "sample": 20,
        "token": 200,
        "batch_in_epoch": 0,
        "sample_in_epoch": 0,
        "token_in_epoch": 0,
    }
    assert (timestamp.total_wct, timestamp.epoch_wct, timestamp.batch_wct) == (9 * second, timedelta(0), timedelta(0))

    timestamp = timestamp.to_next_batch(8)  # tokens and duration default to 0
    assert _counts(timestamp) == {
        "epoch": 1,
        "batch": 4,
        "sample": 28,
        "token": 200,
        "batch_in_epoch": 1,
        "sample_in_epoch": 8,
        "token_in_epoch": 0,
    }
    assert (timestamp.total_wct, timestamp.epoch_wct, timestamp.batch_wct) == (9 * second, timedelta(0), timedelta(0))
    assert timestamp.batch.unit is TimeUnit.BATCH
    assert timestamp.sample_in_epoch.unit is TimeUnit.SAMPLE


def test_the_loop_reads_the_batches_of_the_epoch_as_the_counter_says() -> None:
    """The training loop reads ``batches_in_epoch`` each batch instead of building ``batch_in_epoch``'s Time."""
    timestamp = Timestamp(epoch=1, batch=7, batch_in_epoch=3)
    seen = []
    for _ in range(3):
        seen.append((batches_in_epoch(timestamp), int(timestamp.batch_in_epoch)))
        timestamp = timestamp.to_next_batch(8)
    seen.append((batches_in_epoch(timestamp.to_next_epoch()), int(timestamp.to_next_epoch().batch_in_epoch)))
    assert seen == [(3, 3), (4, 4), (5, 5), (0, 0)]


def test_advancing_returns_a_new_timestamp() -> None:
    start = Timestamp()
    after = start.to_next_batch(4).to_next_epoch()
    assert start == Timestamp()
    assert after != start
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'batch'"):
        start.batch = Time.from_batch(3)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'batch'"):
        del start.batch  # type: ignore[misc]
    assert start == Timestamp()


def test_a_timestamp_pickled_with_timedelta_clocks_still_loads() -> None:
    """Earlier versions kept the clocks as timedeltas in the tuple a pickle holds; unpickling calls the Timestamp's
    reducer with that tuple."""
    timestamp = Timestamp(batch=3, batch_in_epoch=3, total_wct=timedelta(seconds=2))
    rebuild, (values,) = timestamp.__reduce__()
    assert values == (0, 3, 0, 0, 3, 0, 0, 2.0, 0.0, 0.0)
    earlier = (0, 3, 0, 0, 3, 0, 0, timedelta(seconds=2), timedelta(0), timedelta(0))
    assert rebuild(earlier) == rebuild(values) == timestamp


def test_a_duration_in_float_seconds_advances_the_clocks_as_the_same_timedelta() -> None:
    by_seconds = Timestamp().to_next_batch(2, duration=0.25).to_next_batch(2, duration=1.5).to_next_epoch(0.125)
    by_timedelta = (
        Timestamp()
        .to_next_batch(2, duration=timedelta(seconds=0.25))
        .to_next_batch(2, duration=timedelta(seconds=1.5))
        .to_next_epoch(timedelta(seconds=0.125))
    )
    assert by_seconds == by_timedelta
    assert by_seconds.total_wct == timedelta(seconds=1.875)
    assert type(by_seconds.total_wct) is timedelta and by_seconds.epoch_wct == timedelta(0)
    assert by_seconds.state_dict()["total_wct"] == 1.875
    assert Timestamp.from_state_dict(by_seconds.state_dict()) == by_seconds


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda t: t.to_next_batch(-1), ValueError, "to_next_batch samples: A Time cannot be negative"),
        (lambda t: t.to_next_batch(2.0), TypeError, "to_next_batch samples: A Time in 'sp' needs an integer"),
        (lambda t: t.to_next_batch(2, tokens=-1), ValueError, "to_next_batch tokens: A Time cannot be negative"),
        (
            lambda t: t.to_next_batch(2, duration="1s"),
            TypeError,
            "to_next_batch duration must be a datetime.timedelta or float seconds, got str",
        ),
        (lambda t: t.to_next_batch(2, duration=True), TypeError, "to_next_batch duration must be a datetime.timedelta"),
        (lambda t: t.to_next_batch(2, duration=-0.5), ValueError, "to_next_batch duration must be finite and not neg"),
        (lambda t: t.to_next_batch(2, duration=math.nan), ValueError, "must be finite and not negative, got nan"),
        (lambda t: t.to_next_batch(2, duration=-timedelta(1)), ValueError, "to_next_batch duration cannot be negative"),
        (lambda t: t.to_next_epoch(duration=-timedelta(1)), ValueError, "to_next_epoch duration cannot be negative"),
    ],
)
def test_advancing_validates_its_arguments(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call(Timestamp())


def test_get_returns_the_count_in_each_unit() -> None:
    timestamp = Timestamp(epoch=2, batch=30, sample=960, token=9600, batch_in_epoch=5)
    assert timestamp.get(TimeUnit.EPOCH) == Time.from_epoch(2)
    assert timestamp.get(TimeUnit.BATCH) == Time.from_batch(30)
    assert timestamp.get(TimeUnit.SAMPLE) == Time.from_sample(960)
    assert timestamp.get(TimeUnit.TOKEN) == Time.from_token(9600)
    assert timestamp.get("ba") == Time.from_batch(30)
    with pytest.raises(ValueError, match=re.escape("'dur' is a fraction of max_duration, so use elapsed_fraction(")):
        timestamp.get(TimeUnit.DURATION)
    with pytest.raises(ValueError, match="Unknown time unit 'xx'"):
        timestamp.get("xx")


def test_timestamp_compares_the_matching_counter() -> None:
    timestamp = Timestamp(epoch=1, batch=3, sample=96, token=1000)
    assert timestamp >= Time.from_timestring("3ba")
    assert timestamp <= Time.from_timestring("3ba")
    assert not timestamp > Time.from_timestring("3ba")
    assert timestamp < Time.from_timestring("4ba")
    assert timestamp > Time.from_timestring("0ep")
    assert timestamp < Time.from_timestring("2ep")
    assert timestamp >= Time.from_timestring("96sp")
    assert timestamp < Time.from_timestring("1001tok")
    # The Time on the left works too (Python reflects to the Timestamp).
    assert Time.from_timestring("3ba") <= timestamp
    assert Time.from_timestring("2ba") < timestamp
    assert not Time.from_timestring("3ba") < timestamp


def test_timestamp_comparison_errors() -> None:
    timestamp = Timestamp(batch=3)
    with pytest.raises(ValueError, match="'dur' is a fraction of max_duration"):
        _ = timestamp >= Time.from_timestring("0.5dur")
    with pytest.raises(TypeError):
        _ = timestamp >= 3  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = timestamp < Timestamp()  # type: ignore[operator]
    assert timestamp != Time.from_batch(3)  # == compares whole Timestamps; compare one counter explicitly
    assert timestamp.batch == Time.from_batch(3)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"batch": -1}, ValueError, "Timestamp batch: A Time cannot be negative, got -1 ('ba')."),
        ({"epoch": 1.0}, TypeError, "Timestamp epoch: A Time in 'ep' needs an integer, got 1.0."),
        ({"batch": Time.from_epoch(1)}, ValueError, "Timestamp batch is counted in 'ba', got 1ep."),
        ({"batch": 2, "batch_in_epoch": 3}, ValueError, "Timestamp batch_in_epoch (3ba) cannot exceed batch (2ba)."),
        ({"sample_in_epoch": 1}, ValueError, "Timestamp sample_in_epoch (1sp) cannot exceed sample (0sp)."),
        ({"token_in_epoch": 1}, ValueError, "Timestamp token_in_epoch (1tok) cannot exceed token (0tok)."),
        ({"total_wct": 3.0}, TypeError, "Timestamp total_wct must be a datetime.timedelta, got float."),
        ({"batch_wct": -timedelta(seconds=1)}, ValueError, "Timestamp batch_wct cannot be negative"),
    ],
)
def test_timestamp_validates_its_fields(fields: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        Timestamp(**fields)


def test_timestamp_fields_can_be_given_as_times() -> None:
    timestamp = Timestamp(epoch=Time.from_epoch(2), batch=Time.from_batch(7))
    assert _counts(timestamp)["epoch"] == 2
    assert _counts(timestamp)["batch"] == 7


def test_copy_replaces_fields() -> None:
    timestamp = Timestamp(epoch=1, batch=10, sample=320)
    changed = timestamp.copy(batch=12, total_wct=timedelta(seconds=4))
    assert _counts(changed) == {**_counts(timestamp), "batch": 12}
    assert changed.total_wct == timedelta(seconds=4)
    assert timestamp.batch == Time.from_batch(10)
    assert timestamp.copy() == timestamp
    assert timestamp.copy(batch=None) == timestamp  # None keeps a field
    assert dataclasses.replace(timestamp, batch=12, total_wct=timedelta(seconds=4)) == changed
    with pytest.raises(ValueError, match=re.escape("batch_in_epoch (11ba) cannot exceed batch (10ba)")):
        timestamp.copy(batch_in_epoch=11)
    with pytest.raises(ValueError, match=re.escape("batch_in_epoch (11ba) cannot exceed batch (10ba)")):
        dataclasses.replace(timestamp, batch_in_epoch=11)
    with pytest.raises(TypeError):
        timestamp.copy(batches=3)  # type: ignore[call-arg]


def test_timestamp_equality_hash_pickle_and_repr() -> None:
    timestamp = Timestamp(epoch=1, batch=3, sample=96, total_wct=timedelta(seconds=1, microseconds=7))
    same = Timestamp(epoch=1, batch=3, sample=96, total_wct=timedelta(seconds=1, microseconds=7))
    assert timestamp == same
    assert hash(timestamp) == hash(same)
    assert timestamp != timestamp.copy(token=1)
    assert pickle.loads(pickle.dumps(timestamp)) == timestamp
    assert copy.deepcopy(timestamp) == timestamp
    assert repr(Timestamp(batch=2, batch_in_epoch=1)) == (
        "Timestamp(epoch=0, batch=2, sample=0, token=0, batch_in_epoch=1, sample_in_epoch=0, token_in_epoch=0, "
        "total_wct=datetime.timedelta(0), epoch_wct=datetime.timedelta(0), batch_wct=datetime.timedelta(0))"
    )


# --- checkpoints ----------------------------------------------------------------------------------


def test_state_dict_round_trip_through_torch_weights_only(tmp_path: Path) -> None:
    timestamp = (
        Timestamp()
        .to_next_batch(32, tokens=4096, duration=timedelta(seconds=1, microseconds=250))
        .to_next_epoch(duration=timedelta(milliseconds=3))
        .to_next_batch(16, tokens=2048, duration=timedelta(microseconds=999_999))
    )
    state = timestamp.state_dict()
    assert state == {
        "epoch": 1,
        "batch": 2,
        "sample": 48,
        "token": 6144,
        "batch_in_epoch": 1,
        "sample_in_epoch": 16,
        "token_in_epoch": 2048,
        "total_wct": 2.003249,
        "epoch_wct": 0.999999,
        "batch_wct": 0.999999,
    }
    assert all(type(value) is (float if key.endswith("_wct") else int) for key, value in state.items())
    torch.save({"timestamp": state}, tmp_path / "checkpoint.pt")
    loaded = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    restored = Timestamp.from_state_dict(loaded["timestamp"])
    assert restored == timestamp
    assert restored.total_wct == timedelta(seconds=2, microseconds=3249)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch": None}, "Not a Timestamp state dict: missing keys ['batch'], unexpected keys []."),
        ({"steps": 3}, "Not a Timestamp state dict: missing keys [], unexpected keys ['steps']."),
        ({"batch": 1.5}, "Timestamp batch: A Time in 'ba' needs an integer, got 1.5."),
        ({"batch": -1}, "Timestamp batch: A Time cannot be negative, got -1 ('ba')."),
        ({"total_wct": "3"}, "Timestamp state 'total_wct' must be a finite number of seconds, got '3'."),
        ({"epoch_wct": float("nan")}, "Timestamp state 'epoch_wct' must be a finite number of seconds, got nan."),
        ({"batch_wct": -1.0}, "Timestamp batch_wct cannot be negative"),
    ],
)
def test_from_state_dict_rejects_bad_state(change: dict[str, Any], message: str) -> None:
    state: dict[str, Any] = {**Timestamp(batch=3).state_dict(), **change}
    state = {key: value for key, value in state.items() if value is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        Timestamp.from_state_dict(state)


def test_load_state_dict_in_place_is_refused() -> None:
    timestamp = Timestamp()
    with pytest.raises(TypeError, match=re.escape("use `timestamp = Timestamp.from_state_dict(state_dict)`")):
        timestamp.load_state_dict(Timestamp(batch=3).state_dict())
    assert timestamp == Timestamp()


# --- elapsed_fraction -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_duration", "expected"),
    [
        ("4ep", 0.25),
        ("10ba", 0.4),
        ("256sp", 0.5),
        ("8000tok", 0.125),
        ("2ba", 2.0),  # past the end
    ],
)
def test_elapsed_fraction_in_each_unit(max_duration: str, expected: float) -> None:
    timestamp = Timestamp(epoch=1, batch=4, sample=128, token=1000)
    assert elapsed_fraction(timestamp, Time.from_timestring(max_duration)) == pytest.approx(expected)


def test_elapsed_fraction_goes_from_zero_to_one() -> None:
    max_duration = Time.from_batch(3)
    timestamp = Timestamp()
    fractions = [elapsed_fraction(timestamp, max_duration)]
    for _ in range(3):
        timestamp = timestamp.to_next_batch(2)
        fractions.append(elapsed_fraction(timestamp, max_duration))
    assert fractions == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])


@pytest.mark.parametrize(
    ("max_duration", "error", "message"),
    [
        (Time.from_duration(1.0), ValueError, "max_duration must be in ep, ba, sp or tok, not 1.0dur."),
        (Time.from_batch(0), ValueError, "max_duration must be positive, got 0ba."),
        ("10ba", TypeError, "max_duration must be a Time, got str; use Time.from_input()."),
    ],
)
def test_elapsed_fraction_errors(max_duration: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        elapsed_fraction(Timestamp(), max_duration)
