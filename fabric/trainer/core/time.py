"""Training time: amounts of training (:class:`Time`) and the trainer's clock (:class:`Timestamp`).

Durations such as ``max_duration``, evaluation intervals or scheduler warmups are written as time
strings: ``"10ep"``, ``"500ba"``, ``"2048sp"``, ``"1000tok"`` or ``"0.3dur"`` (30% of ``max_duration``).
Keeping the unit with the number means a warmup of ``"100ba"`` can never be mistaken for 100 epochs,
and mixing units is an error instead of a silent miscount.

Samples and tokens are global counts: the trainer adds the global batch size (summed over all
ranks), so the clock reads the same on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import re
from collections.abc import Mapping
from datetime import timedelta
from decimal import Decimal
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, NoReturn, SupportsIndex, TypeVar, cast, overload

__all__ = ["Time", "TimeUnit", "Timestamp", "elapsed_fraction", "ensure_time"]


class TimeUnit(Enum):
    """The unit of a :class:`Time`; the value is its suffix in a time string."""

    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"  # a fraction of max_duration

    # Identity, as equality between units is: a C-level hash, where Enum's hashes the name in Python (the clock
    # looks its counter up by unit every batch).
    __hash__ = object.__hash__

    @property
    def is_integer(self) -> bool:
        """Whether values in this unit are whole counts (everything but ``dur``)."""
        return self is not TimeUnit.DURATION


TValue = TypeVar("TValue", int, float)

_INTEGER_UNITS = "ep|ba|sp|tok"
_TIMESTRING = re.compile(
    rf"(?P<count>[0-9]+)(?P<unit>{_INTEGER_UNITS})|(?P<fraction>[0-9]+(?:\.[0-9]+)?)dur", re.IGNORECASE
)
_ACCEPTED = (
    "Accepted: an integer followed by ep, ba, sp or tok (e.g. '10ep', '500ba'), "
    "or a number followed by dur (e.g. '0.3dur')."
)
_UNIT_NAMES = ", ".join(repr(unit.value) for unit in TimeUnit)
# A float product or quotient this close to a whole number is that number (0.29 * 100 == 28.999999999999996).
_WHOLE_TOLERANCE = 1e-9


def _to_unit(unit: TimeUnit | str) -> TimeUnit:
    if isinstance(unit, TimeUnit):
        return unit
    try:
        return TimeUnit(unit)
    except ValueError:
        raise ValueError(f"Unknown time unit {unit!r}; expected one of {_UNIT_NAMES}.") from None


class Time(Generic[TValue]):
    """An amount of training in one unit, e.g. ``Time(10, TimeUnit.EPOCH)`` or ``Time.from_timestring("10ep")``.

    ``ep``, ``ba``, ``sp`` and ``tok`` hold non-negative integers; ``dur`` holds a non-negative finite
    float, the fraction of ``max_duration``. ``dur`` may exceed 1 (past the end of training), which
    schedulers whose period outlasts training and :func:`elapsed_fraction` need. No value is ever
    negative, so ``a - b`` with ``b > a`` raises instead of producing a time that cannot be written.

    Times are immutable and hashable. As in Composer, the other side of a comparison, ``+`` or ``-`` may be a
    Time, a time string or a plain number read in this Time's unit: ``Time(5, "ba") == 5``,
    ``timestamp.batch < 42``, ``Time(3, "ep") >= "2ep"``, ``Time(5, "ba") + 1``. Two units that differ
    are never equal, and ordering or arithmetic across them raises ``TypeError`` instead of guessing.
    A Time hashes like its value, so ``Time(5, "ba")`` and ``5`` find the same dict entry.
    """

    __slots__ = ("_unit", "_value")
    _value: TValue
    _unit: TimeUnit

    def __init__(self, value: TValue, unit: TimeUnit | str) -> None:
        unit = _to_unit(unit)
        number: int | float
        if isinstance(value, bool) or not isinstance(value, numbers.Real | SupportsIndex):
            raise TypeError(f"A Time value must be a number, got {value!r} ({type(value).__name__}).")
        if unit.is_integer:
            try:
                number = operator.index(value)  # ints, numpy ints and 0-d integer tensors; never floats
            except TypeError:
                raise TypeError(f"A Time in {unit.value!r} needs an integer, got {value!r}.") from None
        else:
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(f"A Time in 'dur' must be finite, got {number!r}.")
        if number < 0:
            raise ValueError(f"A Time cannot be negative, got {number!r} ({unit.value!r}).")
        object.__setattr__(self, "_value", number)
        object.__setattr__(self, "_unit", unit)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_timestring(cls, timestring: str) -> Time[Any]:
        """Parse ``"10ep"``, ``"500ba"``, ``"2048sp"``, ``"1000tok"`` or ``"0.3dur"``.

        Surrounding whitespace and the unit's case (``"10EP"``, as Composer) are ignored; anything else (signs,
        exponents, ``_``, inner spaces, a fraction of an integer unit) is a ``ValueError`` that lists the accepted
        forms.
        """
        if not isinstance(timestring, str):
            raise TypeError(f"Expected a time string such as '10ep', got {type(timestring).__name__}.")
        match = _TIMESTRING.fullmatch(timestring.strip())
        if match is None:
            raise ValueError(f"Time string {timestring!r} is not valid. {_ACCEPTED}")
        if match["fraction"] is not None:
            return Time(float(match["fraction"]), TimeUnit.DURATION)
        return Time(int(match["count"]), TimeUnit(match["unit"].lower()))

    @classmethod
    def from_input(
        cls, value: Time[Any] | str | int | float, default_unit: TimeUnit | str = TimeUnit.EPOCH
    ) -> Time[Any]:
        """Accept what users write for a duration: a Time (as is), a time string, or a number in ``default_unit``."""
        if isinstance(value, Time):
            return value
        if isinstance(value, str):
            return cls.from_timestring(value)
        if isinstance(value, numbers.Real | SupportsIndex) and not isinstance(value, bool):
            return Time(cast(Any, value), default_unit)
        raise TypeError(
            f"Expected a Time, a time string such as '10ep' or a number, got {value!r} ({type(value).__name__})."
        )

    @classmethod
    def from_epoch(cls, epoch: int) -> Time[int]:
        return Time(epoch, TimeUnit.EPOCH)

    @classmethod
    def from_batch(cls, batch: int) -> Time[int]:
        return Time(batch, TimeUnit.BATCH)

    @classmethod
    def from_sample(cls, sample: int) -> Time[int]:
        return Time(sample, TimeUnit.SAMPLE)

    @classmethod
    def from_token(cls, token: int) -> Time[int]:
        return Time(token, TimeUnit.TOKEN)

    @classmethod
    def from_duration(cls, duration: float) -> Time[float]:
        return Time(float(duration), TimeUnit.DURATION)

    # --- access -------------------------------------------------------------------------------

    @property
    def value(self) -> TValue:
        return self._value

    @property
    def unit(self) -> TimeUnit:
        return self._unit

    def __int__(self) -> int:
        if self._unit is _DURATION:  # not ``is_integer`` (a property call) nor ``TimeUnit.DURATION``: runs per batch
            raise TypeError(f"int() of {self} would drop the fraction; use float().")
        return int(self._value)

    def __float__(self) -> float:
        return float(self._value)

    def __str__(self) -> str:
        if self._unit.is_integer:
            return f"{self._value}{self._unit.value}"
        digits = format(Decimal(repr(self._value)), "f")  # shortest round-tripping digits, never an exponent
        return f"{digits if '.' in digits else digits + '.0'}dur"

    def __repr__(self) -> str:
        return f"Time({self._value!r}, TimeUnit.{self._unit.name})"

    def __hash__(self) -> int:
        return hash(self._value)  # equal to a plain number of the same value, so hashes must match

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"Time is immutable; cannot set {name!r}.")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"Time is immutable; cannot delete {name!r}.")

    def __reduce__(self) -> tuple[type[Time[Any]], tuple[TValue, TimeUnit]]:
        return (Time, (self._value, self._unit))

    # --- arithmetic ---------------------------------------------------------------------------

    def _same_unit(self, other: Time[Any], verb: str) -> None:
        if other._unit is not self._unit:
            raise TypeError(
                f"Cannot {verb} {self} and {other}: the units differ ({self._unit.value!r} and {other._unit.value!r})."
            )

    def _scaled(self, result: float, expression: str) -> Time[TValue]:
        """A Time from a scaled value; integer units insist on a whole count rather than silently rounding."""
        if self._unit.is_integer and not isinstance(result, int):
            whole = round(result) if math.isfinite(result) else None
            if whole is None or abs(result - whole) > _WHOLE_TOLERANCE * max(1.0, abs(result)):
                raise self._not_whole(expression, result)
            result = whole
        return Time(cast(Any, result), self._unit)

    def _not_whole(self, expression: str, result: float) -> ValueError:
        return ValueError(
            f"{expression} = {result!r} is not a whole number of {self._unit.value!r}; "
            f"round it explicitly, e.g. Time(round(...), {self._unit.value!r})."
        )

    def _as_time(self, other: object) -> Time[Any] | None:
        """``other`` as a Time: a Time, a time string, or a number in this unit; None for anything else."""
        if isinstance(other, Time):
            return other
        if isinstance(other, str):
            return Time.from_timestring(other)
        if isinstance(other, numbers.Real | SupportsIndex) and not isinstance(other, bool):
            return Time(cast(Any, other), self._unit)
        return None

    def __add__(self, other: Time[TValue] | str | int | float) -> Time[TValue]:
        time = self._as_time(other)
        if time is None:
            return NotImplemented
        self._same_unit(time, "add")
        return Time(self._value + time._value, self._unit)

    __radd__ = __add__

    def __sub__(self, other: Time[TValue] | str | int | float) -> Time[TValue]:
        time = self._as_time(other)
        if time is None:
            return NotImplemented
        return self._difference(self, time)

    def __rsub__(self, other: str | int | float) -> Time[TValue]:
        time = self._as_time(other)
        return NotImplemented if time is None else self._difference(time, self)

    @staticmethod
    def _difference(left: Time[Any], right: Time[Any]) -> Time[Any]:
        left._same_unit(right, "subtract")
        if right._value > left._value:
            raise ValueError(f"{left} - {right} would be negative; a Time cannot be negative.")
        return Time(left._value - right._value, left._unit)

    def __mul__(self, factor: int | float) -> Time[TValue]:
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            return NotImplemented
        return self._scaled(self._value * factor, f"{self} * {factor!r}")

    __rmul__ = __mul__

    @overload
    def __truediv__(self, other: Time[Any]) -> float: ...

    @overload
    def __truediv__(self, other: int | float) -> Time[TValue]: ...

    def __truediv__(self, other: Time[Any] | int | float) -> float | Time[TValue]:
        """``Time / Time`` (same unit) is their ratio; ``Time / number`` is a Time in the same unit."""
        if isinstance(other, Time):
            self._same_unit(other, "divide")
            return float(self._value / other._value)
        if isinstance(other, bool) or not isinstance(other, int | float):
            return NotImplemented
        expression = f"{self} / {other!r}"
        if isinstance(self._value, int) and isinstance(other, int):  # exact, even beyond float precision
            whole, remainder = divmod(self._value, other)
            if remainder:
                raise self._not_whole(expression, self._value / other)
            return Time(cast(Any, whole), self._unit)
        return self._scaled(self._value / other, expression)

    def __mod__(self, other: Time[TValue] | str | int | float) -> Time[TValue]:
        """The remainder in this unit: ``Time(10, "ba") % 4 == Time(2, "ba")``, or ``% "4ba"``."""
        time = self._as_time(other)
        if time is None:
            return NotImplemented
        self._same_unit(time, "take the remainder of")
        if time._value == 0:
            raise ZeroDivisionError(f"{self} % {time}: the divisor is zero.")
        return Time(self._value % time._value, self._unit)

    def __pos__(self) -> Time[TValue]:
        return self

    def __neg__(self) -> Time[TValue]:
        """Only ``-Time(0, ...)``: a Time cannot be negative (Composer's can); subtract instead, ``a - b``."""
        if self._value == 0:
            return self
        raise ValueError(f"-{self} would be negative; a Time cannot be negative. Subtract instead: a - {self}.")

    # --- comparison ---------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Time):
            return self._unit is other._unit and self._value == other._value
        if isinstance(other, str):
            try:
                other = Time.from_timestring(other)
            except ValueError:
                return False
            return self._unit is other._unit and self._value == other._value
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            return bool(self._value == other)
        return NotImplemented

    def _compared(self, other: object) -> int | float | None:
        """The number ``self`` is ordered against: a same-unit Time's or time string's value, or a plain number."""
        if other.__class__ is Time and other._unit is self._unit:  # the per-batch case (timestamp >= max_duration)
            return cast("int | float", other._value)
        if isinstance(other, bool):
            return None
        if isinstance(other, numbers.Real):
            return cast("int | float", other)
        if not isinstance(other, Time | str):
            return None
        time = Time.from_timestring(other) if isinstance(other, str) else other
        self._same_unit(time, "compare")
        return cast("int | float", time._value)

    def __lt__(self, other: Time[Any] | str | int | float) -> bool:
        value = self._compared(other)
        return NotImplemented if value is None else self._value < value

    def __le__(self, other: Time[Any] | str | int | float) -> bool:
        value = self._compared(other)
        return NotImplemented if value is None else self._value <= value

    def __gt__(self, other: Time[Any] | str | int | float) -> bool:
        value = self._compared(other)
        return NotImplemented if value is None else self._value > value

    def __ge__(self, other: Time[Any] | str | int | float) -> bool:
        value = self._compared(other)
        return NotImplemented if value is None else self._value >= value


_ZERO = timedelta(0)
_IN_EPOCH = "_in_epoch"
# For the per-batch clock: on Python 3.11 reading a member through its Enum class (``TimeUnit.BATCH``) runs the
# metaclass's ``__getattr__`` hook, several times the cost of a module global.
_EPOCH, _BATCH, _SAMPLE, _TOKEN = TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN
_DURATION = TimeUnit.DURATION


def _counter(name: str, value: int | Time[int], unit: TimeUnit) -> Time[int]:
    if isinstance(value, Time):
        if value.unit is not unit:
            raise ValueError(f"{name} is counted in {unit.value!r}, got {value}.")
        return value
    try:
        return Time(value, unit)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None


def _count(name: str, value: int | Time[int], unit: TimeUnit) -> int:
    """``value`` (a Time in ``unit`` or a number) as a plain count, or an error naming it."""
    return int(_counter(name, value, unit).value)


def _clock(name: str, value: timedelta) -> float:
    """``value`` (a timedelta) as the float seconds a Timestamp keeps, or an error naming it."""
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta, got {type(value).__name__}.")
    if value < _ZERO:
        raise ValueError(f"{name} cannot be negative, got {value!r}.")
    return value.total_seconds()


def _seconds(name: str, value: timedelta | float) -> float:
    """A duration given as a timedelta or as float seconds, as float seconds; negative, infinite or NaN raise."""
    if isinstance(value, timedelta):
        return _clock(name, value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a datetime.timedelta or float seconds, got {type(value).__name__}.")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and not negative, got {value!r} seconds.")
    return float(value)


def _trusted_time(value: int, unit: TimeUnit) -> Time[int]:
    """A Time built without validation, for values that are valid by construction (hot path)."""
    time: Time[int] = object.__new__(Time)
    _set_time_value(time, value)
    _set_time_unit(time, unit)
    return time


_set_time_value = vars(Time)["_value"].__set__
_set_time_unit = vars(Time)["_unit"].__set__


class _Field:
    """One field of a :class:`Timestamp`: its value at ``index`` in the Timestamp's tuple, a counter read as a Time.

    The Timestamp keeps plain ints and float seconds in one tuple, so a batch builds one tuple rather than a Time per
    counter and adds floats rather than timedeltas (whose arithmetic cost the per-batch path more than the rest of
    its clock); a counter becomes a Time and a clock a timedelta when it is read. Read on the class (as
    ``dataclasses`` does), the field's default.
    """

    __slots__ = ("default", "index", "name", "unit")

    def __init__(self, index: int, unit: TimeUnit | None) -> None:
        self.index, self.unit = index, unit
        self.default: Time[int] | timedelta = _ZERO if unit is None else _trusted_time(0, unit)
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, timestamp: Timestamp | None, owner: type | None = None) -> Any:
        if timestamp is None:
            return self.default
        value = timestamp._values[self.index]
        return timedelta(seconds=value) if self.unit is None else _trusted_time(value, self.unit)

    def __set__(self, timestamp: Timestamp, value: object) -> NoReturn:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {self.name!r}")

    def __delete__(self, timestamp: Timestamp) -> NoReturn:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {self.name!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timestamp:
    """The trainer's clock: how much training has happened, in every unit, plus wall-clock time.

    Counters are :class:`Time` values (``int(timestamp.batch)`` is a plain int); ``*_in_epoch`` restart
    at every epoch. ``sample`` and ``token`` are global counts across ranks. ``total_wct``, ``epoch_wct``
    and ``batch_wct`` are the wall-clock time of the whole run, the current epoch and the last batch.
    The constructor and :meth:`copy` also take plain ints for the counters.

    Immutable: :meth:`to_next_batch`, :meth:`to_next_epoch` and :meth:`copy` return new Timestamps, so a
    reference held by a callback or logger never changes under it. ``timestamp >= Time.from_timestring("3ba")``
    compares the matching counter; ``==`` compares whole Timestamps (use ``timestamp.batch == time`` for one
    counter). For checkpoints, :meth:`state_dict` holds only ints and float seconds and
    :meth:`from_state_dict` rebuilds the Timestamp; the owner (the trainer's state) replaces its reference.
    """

    __slots__ = ("_values",)
    if TYPE_CHECKING:  # not a dataclass field: the one tuple the fields below read
        _values: tuple[Any, ...]

    epoch: Time[int] = _Field(0, _EPOCH)  # type: ignore[assignment]
    """Completed epochs."""
    batch: Time[int] = _Field(1, _BATCH)  # type: ignore[assignment]
    """Completed batches (optimizer steps) over the whole run."""
    sample: Time[int] = _Field(2, _SAMPLE)  # type: ignore[assignment]
    """Samples trained on over the whole run, summed over all ranks."""
    token: Time[int] = _Field(3, _TOKEN)  # type: ignore[assignment]
    """Tokens trained on over the whole run, summed over all ranks."""
    batch_in_epoch: Time[int] = _Field(4, _BATCH)  # type: ignore[assignment]
    sample_in_epoch: Time[int] = _Field(5, _SAMPLE)  # type: ignore[assignment]
    token_in_epoch: Time[int] = _Field(6, _TOKEN)  # type: ignore[assignment]
    total_wct: timedelta = _Field(7, None)  # type: ignore[assignment]
    epoch_wct: timedelta = _Field(8, None)  # type: ignore[assignment]
    batch_wct: timedelta = _Field(9, None)  # type: ignore[assignment]

    def __init__(
        self,
        *,
        epoch: int | Time[int] = 0,
        batch: int | Time[int] = 0,
        sample: int | Time[int] = 0,
        token: int | Time[int] = 0,
        batch_in_epoch: int | Time[int] = 0,
        sample_in_epoch: int | Time[int] = 0,
        token_in_epoch: int | Time[int] = 0,
        total_wct: timedelta = _ZERO,
        epoch_wct: timedelta = _ZERO,
        batch_wct: timedelta = _ZERO,
    ) -> None:
        """Plain ints or Times for the counters; every field is checked: a Timestamp is always a clock that could
        have run."""
        given = locals()  # the arguments by name, read in the order of the Timestamp's tuple
        values: tuple[Any, ...] = tuple(
            _count(f"Timestamp {name}", given[name], unit) if unit else _clock(f"Timestamp {name}", given[name])
            for name, unit in _FIELD_UNITS.items()
        )
        for name, index in _FIELD_INDEX.items():
            if name.endswith(_IN_EPOCH):
                total = name.removesuffix(_IN_EPOCH)
                in_epoch, whole_run = values[index], values[_FIELD_INDEX[total]]
                if in_epoch > whole_run:
                    unit = _FIELD_UNITS[name].value  # type: ignore[union-attr]
                    raise ValueError(f"Timestamp {name} ({in_epoch}{unit}) cannot exceed {total} ({whole_run}{unit}).")
        _set_values(self, values)

    def get(self, unit: TimeUnit | str) -> Time[int]:
        """The total count in ``unit``; ``dur`` is an error because a fraction needs ``max_duration``."""
        unit = _to_unit(unit)
        if unit is TimeUnit.DURATION:
            raise ValueError(
                "A Timestamp counts ep, ba, sp and tok; 'dur' is a fraction of max_duration, "
                "so use elapsed_fraction(timestamp, max_duration) or convert the Time to max_duration's unit."
            )
        return _trusted_time(self._values[_TOTALS[unit]], unit)

    # --- advancing ----------------------------------------------------------------------------

    def to_next_batch(self, samples: int, tokens: int = 0, duration: timedelta | float = 0.0) -> Timestamp:
        """The clock after one more batch of ``samples`` samples and ``tokens`` tokens (global counts).

        ``duration`` is the batch's wall-clock time (a timedelta, or float seconds as the Trainer passes it): it
        becomes ``batch_wct`` and adds to the other clocks. This runs once per batch, so only the arguments are
        validated; the new counters are valid by construction.
        """
        if type(samples) is not int or samples < 0:  # checked inline: plain counts, the per-batch case, pass through
            samples = _count("to_next_batch samples", samples, TimeUnit.SAMPLE)
        if type(tokens) is not int or tokens < 0:
            tokens = _count("to_next_batch tokens", tokens, TimeUnit.TOKEN)
        if type(duration) is not float or not duration >= 0.0:  # NaN fails too
            duration = _seconds("to_next_batch duration", duration)
        return advanced(self, samples, tokens, duration)

    def to_next_epoch(self, duration: timedelta | float = 0.0) -> Timestamp:
        """The clock after the epoch ends: ``epoch + 1``, in-epoch counters and epoch/batch clocks reset.

        ``duration`` is time spent since the last batch (e.g. end-of-epoch evaluation); it adds to ``total_wct``.
        """
        duration = _seconds("to_next_epoch duration", duration)
        epoch, batch, sample, token, *_, total, _, _ = self._values
        new: Timestamp = _new(Timestamp)
        _set_values(new, (epoch + 1, batch, sample, token, 0, 0, 0, total + duration, 0.0, 0.0))
        return new

    def copy(self, **changes: int | Time[int] | timedelta | None) -> Timestamp:
        """A new Timestamp with the given fields replaced (validated like the constructor; None keeps a field)."""
        kept: dict[str, Any] = {name: value for name, value in changes.items() if value is not None}
        return dataclasses.replace(self, **kept)

    # --- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int | float]:
        """Counters as ints and clocks as float seconds: safe for ``torch.load(weights_only=True)``."""
        return dict(zip(_FIELD_UNITS, self._values, strict=True))

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any]) -> Timestamp:
        """Rebuild a Timestamp from :meth:`state_dict`; missing, unknown or invalid entries raise ``ValueError``."""
        missing = sorted(set(_FIELD_UNITS) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(_FIELD_UNITS))
        if missing or unexpected:
            raise ValueError(f"Not a Timestamp state dict: missing keys {missing}, unexpected keys {unexpected}.")
        fields = dict(state_dict)
        for name, unit in _FIELD_UNITS.items():
            seconds = state_dict[name]
            if unit is not None:
                continue
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
                raise ValueError(f"Timestamp state {name!r} must be a finite number of seconds, got {seconds!r}.")
            fields[name] = timedelta(seconds=seconds)
        try:
            return cls(**fields)
        except TypeError as error:
            raise ValueError(str(error)) from None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> NoReturn:
        """Always raises: a Timestamp is immutable. Use ``timestamp = Timestamp.from_state_dict(state_dict)``.

        This exists so that a Timestamp handed straight to ``fabric.load`` fails loudly instead of
        being "loaded" by a method that returns a new object nobody keeps.
        """
        raise TypeError(
            "Timestamp is immutable and cannot load state in place; "
            "use `timestamp = Timestamp.from_state_dict(state_dict)` and keep the result."
        )

    def __reduce__(self) -> tuple[Any, tuple[tuple[Any, ...]]]:
        """Pickled and copied as its values, rebuilt (and checked) by the constructor."""
        return _from_values, (self._values,)

    # --- comparison and display ---------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return self._values == other._values if other.__class__ is Timestamp else NotImplemented

    def __hash__(self) -> int:
        return hash(self._values)

    def _counter_for(self, other: object) -> tuple[Time[int], Time[Any]] | None:
        """The counter in ``other``'s unit and ``other`` as a Time, for a Time or time string; None otherwise."""
        if isinstance(other, str):
            other = Time.from_timestring(other)
        if not isinstance(other, Time):
            return None
        return self.get(other._unit), other

    def __lt__(self, other: Time[Any] | str) -> bool:
        pair = self._counter_for(other)
        return NotImplemented if pair is None else pair[0] < pair[1]

    def __le__(self, other: Time[Any] | str) -> bool:
        pair = self._counter_for(other)
        return NotImplemented if pair is None else pair[0] <= pair[1]

    def __gt__(self, other: Time[Any] | str) -> bool:
        pair = self._counter_for(other)
        return NotImplemented if pair is None else pair[0] > pair[1]

    def __ge__(self, other: Time[Any] | str) -> bool:
        pair = self._counter_for(other)
        return NotImplemented if pair is None else pair[0] >= pair[1]

    def __repr__(self) -> str:
        """Counters as plain numbers, clocks as timedeltas: ``Timestamp(epoch=0, batch=2, ..., batch_wct=...)``."""
        shown = ", ".join(
            f"{name}={value if unit else timedelta(seconds=value)!r}"
            for (name, unit), value in zip(_FIELD_UNITS.items(), self._values, strict=True)
        )
        return f"Timestamp({shown})"


def advanced(timestamp: Timestamp, samples: int, tokens: int, seconds: float) -> Timestamp:
    """:meth:`Timestamp.to_next_batch` for counts valid by construction (ints and float seconds, none negative):
    the training loop's, which counts them itself, every batch."""
    epoch, batch, sample, token, batch_in_epoch, sample_in_epoch, token_in_epoch, total, in_epoch, _ = timestamp._values
    new: Timestamp = _new(Timestamp)
    _set_values(
        new,
        (
            epoch, batch + 1, sample + samples, token + tokens, batch_in_epoch + 1, sample_in_epoch + samples,
            token_in_epoch + tokens, total + seconds, in_epoch + seconds, seconds,
        ),
    )  # fmt: skip
    return new


def reached(timestamp: Timestamp, duration: Time[Any]) -> bool:
    """Whether ``timestamp`` is at ``duration`` or past it, in ``duration``'s unit (``timestamp >= duration``
    without a call of ``__ge__``: the training loop asks it every batch)."""
    if duration.__class__ is not Time or (index := _TOTALS.get(duration._unit)) is None:
        return bool(timestamp >= duration)  # a time string, or a unit no counter holds (which raises there)
    return timestamp._values[index] >= duration._value  # type: ignore[no-any-return]


def batches_in_epoch(timestamp: Timestamp) -> int:
    """``int(timestamp.batch_in_epoch)`` without building a Time: the training loop asks it every batch."""
    return timestamp._values[4]  # type: ignore[no-any-return]


def _from_values(values: tuple[Any, ...]) -> Timestamp:
    """A Timestamp from its tuple (counters, then clocks in seconds, or timedeltas as pickles of earlier versions
    hold them), checked by the constructor."""
    fields: dict[str, Any] = {
        name: value if unit or isinstance(value, timedelta) else timedelta(seconds=value)
        for (name, unit), value in zip(_FIELD_UNITS.items(), values, strict=True)
    }
    return Timestamp(**fields)


_new = object.__new__
_set_values = vars(Timestamp)["_values"].__set__
#: Each field's name and unit (None for a clock), in the order of the Timestamp's tuple.
_FIELD_UNITS: dict[str, TimeUnit | None] = {
    field.name: field.default.unit if isinstance(field.default, Time) else None
    for field in dataclasses.fields(Timestamp)
}
_FIELD_INDEX = {name: index for index, name in enumerate(_FIELD_UNITS)}
assert all(vars(Timestamp)[name].index == index for name, index in _FIELD_INDEX.items())
assert _FIELD_INDEX["batch_in_epoch"] == 4  # what batches_in_epoch reads
#: The place of the counter of each unit over the whole run (not only the current epoch), for Timestamp.get.
_TOTALS = {unit: _FIELD_INDEX[name] for name, unit in _FIELD_UNITS.items() if unit and not name.endswith(_IN_EPOCH)}


def elapsed_fraction(timestamp: Timestamp, max_duration: Time[Any], batches_per_epoch: int | None = None) -> float:
    """How far through training ``timestamp`` is: 0 at the start, 1 at the end (more after it).

    Measured in ``max_duration``'s unit, except that an epoch ``max_duration`` is converted to batches
    through ``batches_per_epoch`` (the train dataloader's length) when it is known, as Composer converts
    ``dur`` times, so the fraction moves every batch. Without it only completed epochs count and the
    fraction moves once per epoch. ``max_duration`` must be positive and not in ``dur``.
    """
    if not isinstance(max_duration, Time):
        raise TypeError(f"max_duration must be a Time, got {type(max_duration).__name__}; use Time.from_input().")
    if max_duration.unit is TimeUnit.DURATION:
        raise ValueError(f"max_duration must be in ep, ba, sp or tok, not {max_duration}.")
    if max_duration.value == 0:
        raise ValueError(f"max_duration must be positive, got {max_duration}.")
    if max_duration.unit is TimeUnit.EPOCH and batches_per_epoch:
        return float(timestamp.batch.value / (max_duration.value * batches_per_epoch))
    return timestamp.get(max_duration.unit) / max_duration


def ensure_time(maybe_time: Time[Any] | str | int | float, int_unit: TimeUnit | str) -> Time[Any]:
    """Composer's ``ensure_time``: a Time as is, a time string parsed, a number in ``int_unit``
    (:meth:`Time.from_input`)."""
    return Time.from_input(maybe_time, int_unit)
