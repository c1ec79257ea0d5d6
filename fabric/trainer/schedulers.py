"""Learning-rate schedules as functions of training time.

A scheduler maps the trainer's state to an LR *multiplier*: ``scheduler(state, ssr) -> float``. It reads only
``state.timestamp`` and ``state.max_duration`` (:class:`SchedulerState`), so the same schedule gives the same
multiplier after a resume. :class:`LRSchedule` sets ``lr = initial_lr * product(multipliers)`` on every param group
at the start of every batch, before its forward pass: batch ``k`` (when ``timestamp.batch == k``) trains with the
multiplier for ``t = k``, with no one-batch lag.

Time arguments are :class:`~fabric.trainer.Time` objects or time strings (``"10ba"``, ``"2ep"``, ``"0.3dur"``),
parsed when the scheduler is built. A bare number is refused because it has no unit. At call time:

* a ``ba``/``sp``/``tok`` argument is compared with ``state.timestamp.get(unit)``, the count in that unit;
* an ``ep`` argument is converted to batches through ``state.dataloader_len`` (the train dataloader's length), as
  Composer does, so ``t_max="3ep"`` with 10 batches per epoch gives 30 learning rates, one per batch;
* a ``dur`` argument is a fraction of ``state.max_duration``, converted to its unit, and to batches through
  ``dataloader_len`` when ``max_duration`` is in epochs: ``"0.3dur"`` of ``max_duration="1ep"`` with 10 batches per
  epoch is batch 3;
* arguments of one formula (a warmup and ``t_max``) must land in one unit after these conversions, else
  ``ValueError``. An ``ep`` argument, or a ``dur`` one under an epoch ``max_duration``, needs the dataloader's length:
  without one (an ``IterableDataset`` with no ``__len__``) the scheduler raises, naming the argument; the Trainer
  checks this at ``fit()``.

Every time argument is measured from the start of training. In the ``*WithWarmup`` schedulers, the warmup runs
over ``[0, t_warmup)``. The main schedule takes over at ``t_warmup``, and its decay runs from ``t_warmup`` to
``t_max``, so the default ``t_max="1dur"`` still ends exactly when training does. Milestones and ``ConstantScheduler``'s
``t_max`` are on the same absolute clock. This matches Composer.

``ssr`` (scale schedule ratio) stretches or compresses the schedule. Every ``ep``/``ba``/``sp``/``tok`` argument is
multiplied by ``ssr`` before the comparison (``ssr=0.5`` halves them), with no rounding; warmups are not scaled unless
the scheduler has ``scale_warmup=True`` (Composer's default is ``False``). A scaled boundary between two
counts takes effect at the first count at or past it, and a product within float rounding of a whole count is
snapped to that count. ``dur`` arguments are *not* scaled. They are fractions of ``max_duration``, which the trainer
itself scales by ``ssr`` (as Composer's does), so scaling them here too would apply the ratio twice.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fabric.trainer.core.time import Time, Timestamp, TimeUnit

__all__ = [
    "ConstantScheduler",
    "ConstantWithWarmupScheduler",
    "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler",
    "CosineAnnealingWithWarmupScheduler",
    "ExponentialScheduler",
    "LRSchedule",
    "LinearScheduler",
    "LinearWithWarmupScheduler",
    "MultiStepScheduler",
    "MultiStepWithWarmupScheduler",
    "PolynomialScheduler",
    "PolynomialWithWarmupScheduler",
    "Scheduler",
    "SchedulerState",
    "StepScheduler",
]

TimeInput = Time[Any] | str
# Float products and quotients this close (relative) to a boundary count as on it: (9 / 30) / 0.1 == 2.9999999999999996.
_REL_TOL = 1e-12


class SchedulerState(Protocol):
    """What a scheduler reads from the trainer's state."""

    @property
    def timestamp(self) -> Timestamp: ...

    @property
    def max_duration(self) -> Time[Any] | None: ...


@runtime_checkable
class Scheduler(Protocol):
    """A function of training time returning an LR multiplier. ``ssr`` scales the schedule's time arguments.
    ``issubclass``/``isinstance`` work (runtime-checkable), as programs check registered schedulers with them."""

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float: ...


# --- helpers ------------------------------------------------------------------------------------


def _parse_time(owner: str, name: str, value: object) -> Time[Any]:
    """A time argument parsed once, with errors that name the scheduler and argument."""
    if not isinstance(value, Time | str):
        raise TypeError(
            f"{owner}: {name} must be a Time or a time string such as '10ba', '2ep' or '0.3dur', "
            f"got {value!r} ({type(value).__name__}); a bare number has no unit."
        )
    try:
        return Time.from_input(value)
    except ValueError as error:
        raise ValueError(f"{owner}: {name}: {error}") from None


def _positive_time(owner: str, name: str, value: object) -> Time[Any]:
    time = _parse_time(owner, name, value)
    if time.value == 0:
        raise ValueError(f"{owner}: {name} must be positive, got {time}.")
    return time


def _number(owner: str, name: str, value: object, minimum: float = 0.0) -> float:
    """A finite real number that is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r} ({type(value).__name__}).")
    number = float(value)
    if not math.isfinite(number) or number < minimum:
        raise ValueError(f"{owner}: {name} must be a finite number >= {minimum:g}, got {number!r}.")
    return number


def _check_ssr(ssr: float) -> None:
    if isinstance(ssr, bool) or not isinstance(ssr, numbers.Real) or not math.isfinite(ssr) or ssr <= 0:
        raise ValueError(f"The scale schedule ratio (ssr) must be a positive finite number, got {ssr!r}.")


def _snap(value: float) -> float:
    """``value``, snapped to a whole count if it is one up to float rounding (``0.3 * 10``, ``29 * 0.01 * 100``)."""
    whole = round(value)
    return float(whole) if math.isclose(value, whole, rel_tol=_REL_TOL) else value


def _reached(now: float, mark: float) -> bool:
    """``now >= mark``, counting float noise around ``mark`` as on it."""
    return now >= mark or math.isclose(now, mark, rel_tol=_REL_TOL)


def _floor(x: float) -> int:
    """``floor(x)``, counting an ``x`` within float noise below a whole number as that number."""
    whole = math.floor(x)
    return whole + 1 if math.isclose(x, whole + 1, rel_tol=_REL_TOL) else whole


def _progress(now: float, start: float, end: float) -> float:
    """How far ``now`` is from ``start`` to ``end``, clamped to [0, 1]. An empty span is already complete."""
    if end <= start or _reached(now, end):
        return 1.0
    return min(1.0, max(0.0, (now - start) / (end - start)))


def _cosine(tau: float, alpha_f: float) -> float:
    return alpha_f + (1.0 - alpha_f) * 0.5 * (1.0 + math.cos(math.pi * tau))


def _polynomial(tau: float, power: float, alpha_f: float) -> float:
    return alpha_f + (1.0 - alpha_f) * math.pow(1.0 - tau, power)


# --- base ---------------------------------------------------------------------------------------


class _TimeScheduler(Scheduler):
    """Shared machinery: putting the current time and time arguments on one axis, and a readable repr."""

    def _place(
        self, state: SchedulerState, ssr: float, *, unscaled: tuple[str, ...] = (), **times: Time[Any]
    ) -> tuple[float, list[float]]:
        """The current time and ``times`` as counts of one unit, with ``ssr`` applied (except to ``unscaled``)."""
        _check_ssr(ssr)
        owner = type(self).__name__
        placed = [_on_axis(owner, name, time, state, 1.0 if name in unscaled else ssr) for name, time in times.items()]
        units = {unit for unit, _ in placed}
        if len(units) > 1:
            arguments = ", ".join(f"{name}={str(time)!r}" for name, time in times.items())
            raise ValueError(
                f"{owner}: cannot compare {arguments} while max_duration is {state.max_duration}: they count "
                f"{' and '.join(sorted(unit.value for unit in units))}. Give them in one unit "
                "('ba' and 'ep' mix, and 'dur' takes max_duration's unit)."
            )
        (unit,) = units
        return float(state.timestamp.get(unit).value), [position for _, position in placed]

    def _warmup(self, state: SchedulerState, ssr: float, t_warmup: Time[Any], scale_warmup: bool) -> float | None:
        """``t / t_warmup`` while warming up; ``None`` once the warmup is over."""
        now, (end,) = self._place(state, ssr if scale_warmup else 1.0, t_warmup=t_warmup)
        return None if _reached(now, end) else now / end

    def arguments(self) -> dict[str, Any]:
        """The constructor's arguments by name, as this scheduler holds them."""
        names = list(inspect.signature(type(self).__init__).parameters)[1:]
        return {name: getattr(self, name) for name in names}

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={_show(value)}" for name, value in self.arguments().items())
        return f"{type(self).__name__}({shown})"


def _show(value: object) -> str:
    """An argument as a user writes it: times as strings (``'100tok'``), lists of them in brackets."""
    if isinstance(value, Time):
        return repr(str(value))
    if isinstance(value, list):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    return repr(value)


def _on_axis(owner: str, name: str, time: Time[Any], state: SchedulerState, ssr: float) -> tuple[TimeUnit, float]:
    """``time`` as ``(unit, count)``: epochs and epoch-based ``dur`` in batches; ``ssr`` scales all but ``dur``."""
    if time.unit is TimeUnit.DURATION:
        max_duration = _max_duration(state)
        if max_duration.unit is TimeUnit.EPOCH:
            batches = max_duration.value * _batches_per_epoch(owner, name, time, state)
            return TimeUnit.BATCH, _snap(float(time.value) * batches)
        return max_duration.unit, _snap(float(time.value) * max_duration.value)
    if time.unit is TimeUnit.EPOCH:
        return TimeUnit.BATCH, _snap(time.value * _batches_per_epoch(owner, name, time, state) * ssr)
    return time.unit, _snap(time.value * ssr)


def _batches_per_epoch(owner: str, name: str, time: Time[Any], state: SchedulerState) -> int:
    length = getattr(state, "dataloader_len", None)
    if not length:
        unit = "an epoch max_duration" if time.unit is TimeUnit.DURATION else "epochs"
        raise ValueError(
            f"{owner}: {name}={str(time)!r} counts {unit}, which convert to batches through the train dataloader's "
            f"length, and the dataloader has none (max_duration={state.max_duration}). Give {name} in 'ba', "
            "'sp' or 'tok' (and max_duration in one of those units for 'dur' times), or give the dataset a __len__."
        )
    return int(length)


def _compatible_units(owner: str, **times: Time[Any]) -> None:
    """Arguments used in one formula must count the same thing: ``ba`` and ``ep`` mix, ``dur`` mixes with any."""
    units = {
        TimeUnit.BATCH if time.unit is TimeUnit.EPOCH else time.unit
        for time in times.values()
        if time.unit is not TimeUnit.DURATION
    }
    if len(units) > 1:
        arguments = ", ".join(f"{name}={str(time)!r}" for name, time in times.items())
        raise ValueError(f"{owner}: {arguments} must be in the same unit ('ba' and 'ep' mix, 'dur' mixes with any).")


def _max_duration(state: SchedulerState) -> Time[Any]:
    if state.max_duration is None:
        raise ValueError("A schedule with 'dur' times needs max_duration, which is not set.")
    return state.max_duration


# --- schedulers ---------------------------------------------------------------------------------


class StepScheduler(_TimeScheduler):
    """Decay by ``gamma`` every ``step_size``: ``m(t) = gamma ** floor(t / step_size)``."""

    def __init__(self, step_size: TimeInput, gamma: float = 0.1) -> None:
        self.step_size = _positive_time(type(self).__name__, "step_size", step_size)
        self.gamma = _number(type(self).__name__, "gamma", gamma)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        now, (step_size,) = self._place(state, ssr, step_size=self.step_size)
        return self.gamma ** _floor(now / step_size)


class MultiStepScheduler(_TimeScheduler):
    """Decay by ``gamma`` at each milestone: ``m(t) = gamma ** (number of milestones m with t >= m)``.

    Milestones may be in different units; each one is compared on its own.
    """

    def __init__(self, milestones: Sequence[TimeInput], gamma: float = 0.1) -> None:
        owner = type(self).__name__
        if isinstance(milestones, str | Time) or not isinstance(milestones, Sequence):
            raise TypeError(
                f"{owner}: milestones must be a list of times such as ['30ep', '60ep'], got {milestones!r}."
            )
        if not milestones:
            raise ValueError(f"{owner}: milestones is empty; give at least one time.")
        self.milestones = [_parse_time(owner, f"milestones[{index}]", value) for index, value in enumerate(milestones)]
        self.gamma = _number(owner, "gamma", gamma)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        reached = 0
        for milestone in self.milestones:
            now, (mark,) = self._place(state, ssr, milestone=milestone)
            reached += _reached(now, mark)
        return self.gamma**reached


class ConstantScheduler(_TimeScheduler):
    """Hold ``alpha`` until ``t_max``, then 1: ``m(t) = alpha if t < t_max else 1``."""

    def __init__(self, alpha: float = 1.0, t_max: TimeInput = "1dur") -> None:
        self.alpha = _number(type(self).__name__, "alpha", alpha)
        self.t_max = _parse_time(type(self).__name__, "t_max", t_max)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        now, (t_max,) = self._place(state, ssr, t_max=self.t_max)
        return 1.0 if _reached(now, t_max) else self.alpha


class LinearScheduler(_TimeScheduler):
    """Go linearly from ``alpha_i`` to ``alpha_f`` by ``t_max``, then hold it.

    ``m(t) = alpha_i + (alpha_f - alpha_i) * tau`` with ``tau = min(1, t / t_max)`` (``tau = 1`` when ``t_max`` is 0).
    """

    def __init__(self, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: TimeInput = "1dur") -> None:
        self.alpha_i = _number(type(self).__name__, "alpha_i", alpha_i)
        self.alpha_f = _number(type(self).__name__, "alpha_f", alpha_f)
        self.t_max = _parse_time(type(self).__name__, "t_max", t_max)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        now, (t_max,) = self._place(state, ssr, t_max=self.t_max)
        return self.alpha_i + (self.alpha_f - self.alpha_i) * _progress(now, 0.0, t_max)


class ExponentialScheduler(_TimeScheduler):
    """Decay smoothly by ``gamma`` per ``decay_period``, with no end: ``m(t) = gamma ** (t / decay_period)``."""

    def __init__(self, gamma: float, decay_period: TimeInput = "1ep") -> None:
        self.gamma = _number(type(self).__name__, "gamma", gamma)
        self.decay_period = _positive_time(type(self).__name__, "decay_period", decay_period)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        now, (decay_period,) = self._place(state, ssr, decay_period=self.decay_period)
        return math.pow(self.gamma, now / decay_period)


class CosineAnnealingScheduler(_TimeScheduler):
    """Half a cosine from 1 down to ``alpha_f`` by ``t_max``, then hold it.

    ``m(t) = alpha_f + (1 - alpha_f) * (1 + cos(pi * tau)) / 2`` with ``tau = min(1, t / t_max)``.
    """

    def __init__(self, t_max: TimeInput = "1dur", alpha_f: float = 0.0) -> None:
        self.t_max = _parse_time(type(self).__name__, "t_max", t_max)
        self.alpha_f = _number(type(self).__name__, "alpha_f", alpha_f)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        now, (t_max,) = self._place(state, ssr, t_max=self.t_max)
        return _cosine(_progress(now, 0.0, t_max), self.alpha_f)


class CosineAnnealingWarmRestartsScheduler(_TimeScheduler):
    """Cosine annealing that restarts at 1. Interval ``i`` lasts ``t_0 * t_mult ** i``.

    ``m(t) = alpha_f + (1 - alpha_f) * (1 + cos(pi * tau_i)) / 2`` with ``tau_i = (t - t_i) / (t_0 * t_mult ** i)``,
    where ``t_i`` is the start of the interval containing ``t``. Interval lengths are not rounded, and ``t_mult``
    must be at least 1 so that the intervals never shrink to nothing.
    """

    def __init__(self, t_0: TimeInput, t_mult: float = 1.0, alpha_f: float = 0.0) -> None:
        self.t_0 = _positive_time(type(self).__name__, "t_0", t_0)
        self.t_mult = _number(type(self).__name__, "t_mult", t_mult, minimum=1.0)
        self.alpha_f = _number(type(self).__name__, "alpha_f", alpha_f)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        now, (t_0,) = self._place(state, ssr, t_0=self.t_0)
        x = now / t_0  # time in units of the first interval
        if self.t_mult == 1.0:
            tau = x - _floor(x)
        else:  # interval lengths grow geometrically, so this loops O(log x) times
            start, length = 0.0, 1.0
            while _reached(x, start + length):
                start += length
                length *= self.t_mult
            tau = (x - start) / length
        return _cosine(min(1.0, max(0.0, tau)), self.alpha_f)


class PolynomialScheduler(_TimeScheduler):
    """Polynomial decay from 1 to ``alpha_f`` by ``t_max``, then hold it.

    ``m(t) = alpha_f + (1 - alpha_f) * (1 - tau) ** power`` with ``tau = min(1, t / t_max)``.
    """

    def __init__(self, power: float, t_max: TimeInput = "1dur", alpha_f: float = 0.0) -> None:
        self.power = _number(type(self).__name__, "power", power)
        self.t_max = _parse_time(type(self).__name__, "t_max", t_max)
        self.alpha_f = _number(type(self).__name__, "alpha_f", alpha_f)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        now, (t_max,) = self._place(state, ssr, t_max=self.t_max)
        return _polynomial(_progress(now, 0.0, t_max), self.power, self.alpha_f)


# --- with warmup --------------------------------------------------------------------------------
#
# Warmup is linear from 0 at t = 0 to the main schedule's starting value at t_warmup: m(t) = (t / t_warmup) * start.
# Like Composer (and Hugging Face's warmup schedules), batch 0 therefore trains with a multiplier of 0. Optimizers
# still record that batch's gradients in their running moments, and the multiplier reaches `start` at t_warmup
# itself. A warmup in epochs, or in dur of an epoch max_duration, counts batches (through the dataloader's length),
# so "1ep" warms up over the first epoch's batches. `scale_warmup=False` (Composer's default) keeps the warmup's length
# when the scale schedule ratio shrinks or stretches the rest of the schedule.
# In the decaying variants, tau_w = min(1, (t - t_warmup) / (t_max - t_warmup)); t_max <= t_warmup is refused (at
# construction when both are in one unit, else at the first batch), as Composer does: it would train at alpha_f.


_END_OF_TRAINING: Time[float] = Time(1.0, TimeUnit.DURATION)


class _WarmupDecay(_TimeScheduler):
    """Linear warmup to 1 over ``[0, t_warmup)``, then a decay over ``[t_warmup, t_max]`` on the same axis."""

    def __init__(self, t_warmup: TimeInput, t_max: TimeInput, scale_warmup: bool) -> None:
        owner = type(self).__name__
        self.t_warmup = _parse_time(owner, "t_warmup", t_warmup)
        self.t_max = _parse_time(owner, "t_max", t_max)
        self.scale_warmup = bool(scale_warmup)
        _compatible_units(owner, t_warmup=self.t_warmup, t_max=self.t_max)
        if self.t_warmup.unit is self.t_max.unit and self.t_max.value <= self.t_warmup.value:
            raise ValueError(self._no_decay_span(str(self.t_warmup), str(self.t_max)))

    def _phase(self, state: SchedulerState, ssr: float) -> tuple[bool, float]:
        """``(True, t / t_warmup)`` while warming up, then ``(False, tau_w)``."""
        unscaled = () if self.scale_warmup else ("t_warmup",)
        now, (t_warmup, t_max) = self._place(state, ssr, unscaled=unscaled, t_warmup=self.t_warmup, t_max=self.t_max)
        if t_max <= t_warmup and self._outlasts_warmup(state, ssr):  # units that meet only on the clock
            placed = f"{self.t_max} = {t_max:g} with max_duration={state.max_duration}"
            raise ValueError(self._no_decay_span(f"{self.t_warmup} = {t_warmup:g}", placed))
        if not _reached(now, t_warmup):
            return True, now / t_warmup
        return False, _progress(now, t_warmup, t_max)

    def _outlasts_warmup(self, state: SchedulerState, ssr: float) -> bool:
        """Whether training goes on after the warmup (also when the two cannot be compared: refuse then)."""
        owner = type(self).__name__
        warmup_unit, warmup = _on_axis(owner, "t_warmup", self.t_warmup, state, ssr if self.scale_warmup else 1.0)
        end_unit, end = _on_axis(owner, "max_duration", _END_OF_TRAINING, state, 1.0)
        return warmup_unit is not end_unit or warmup < end

    def _no_decay_span(self, t_warmup: str, t_max: str) -> str:
        return (
            f"{type(self).__name__}(t_warmup={t_warmup}, t_max={t_max}): t_max must come after t_warmup. The decay "
            "runs from t_warmup to t_max, so the learning rate would drop to alpha_f right after the warmup and "
            "stay there for the rest of training. Give a t_max after t_warmup (or a longer max_duration)."
        )


class MultiStepWithWarmupScheduler(_TimeScheduler):
    """Linear warmup to 1, then :class:`MultiStepScheduler`. Milestones are measured from the start of training.

    ``m(t) = t / t_warmup`` if ``t < t_warmup``, else ``gamma ** (number of milestones m with t >= m)``.
    """

    def __init__(
        self, t_warmup: TimeInput, milestones: Sequence[TimeInput], gamma: float = 0.1, scale_warmup: bool = False
    ) -> None:
        self.t_warmup = _parse_time(type(self).__name__, "t_warmup", t_warmup)
        self._steps = MultiStepScheduler(milestones, gamma)
        self.milestones = self._steps.milestones
        self.gamma = self._steps.gamma
        self.scale_warmup = bool(scale_warmup)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        warming = self._warmup(state, ssr, self.t_warmup, self.scale_warmup)
        return self._steps(state, ssr) if warming is None else warming


class ConstantWithWarmupScheduler(_TimeScheduler):
    """Linear warmup to ``alpha``, then :class:`ConstantScheduler` (``alpha`` until ``t_max``, then 1).

    ``m(t) = (t / t_warmup) * alpha`` if ``t < t_warmup``, else ``alpha`` if ``t < t_max``, else 1.
    """

    def __init__(
        self, t_warmup: TimeInput, alpha: float = 1.0, t_max: TimeInput = "1dur", scale_warmup: bool = False
    ) -> None:
        self.t_warmup = _parse_time(type(self).__name__, "t_warmup", t_warmup)
        self._constant = ConstantScheduler(alpha, t_max)
        self.alpha = self._constant.alpha
        self.t_max = self._constant.t_max
        self.scale_warmup = bool(scale_warmup)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        warming = self._warmup(state, ssr, self.t_warmup, self.scale_warmup)
        return self._constant(state, ssr) if warming is None else warming * self.alpha


class LinearWithWarmupScheduler(_WarmupDecay):
    """Linear warmup to ``alpha_i``, then linear from ``alpha_i`` at ``t_warmup`` to ``alpha_f`` at ``t_max``.

    ``m(t) = (t / t_warmup) * alpha_i`` if ``t < t_warmup``, else ``alpha_i + (alpha_f - alpha_i) * tau_w``.
    """

    def __init__(
        self,
        t_warmup: TimeInput,
        alpha_i: float = 1.0,
        alpha_f: float = 0.0,
        t_max: TimeInput = "1dur",
        scale_warmup: bool = False,
    ) -> None:
        super().__init__(t_warmup, t_max, scale_warmup)
        self.alpha_i = _number(type(self).__name__, "alpha_i", alpha_i)
        self.alpha_f = _number(type(self).__name__, "alpha_f", alpha_f)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        warming, x = self._phase(state, ssr)
        return x * self.alpha_i if warming else self.alpha_i + (self.alpha_f - self.alpha_i) * x


class CosineAnnealingWithWarmupScheduler(_WarmupDecay):
    """Linear warmup to 1, then half a cosine from 1 at ``t_warmup`` to ``alpha_f`` at ``t_max``.

    ``m(t) = t / t_warmup`` if ``t < t_warmup``, else ``alpha_f + (1 - alpha_f) * (1 + cos(pi * tau_w)) / 2``.
    """

    def __init__(
        self, t_warmup: TimeInput, t_max: TimeInput = "1dur", alpha_f: float = 0.0, scale_warmup: bool = False
    ) -> None:
        super().__init__(t_warmup, t_max, scale_warmup)
        self.alpha_f = _number(type(self).__name__, "alpha_f", alpha_f)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        warming, x = self._phase(state, ssr)
        return x if warming else _cosine(x, self.alpha_f)


class PolynomialWithWarmupScheduler(_WarmupDecay):
    """Linear warmup to 1, then polynomial decay from 1 at ``t_warmup`` to ``alpha_f`` at ``t_max``.

    ``m(t) = t / t_warmup`` if ``t < t_warmup``, else ``alpha_f + (1 - alpha_f) * (1 - tau_w) ** power``.
    """

    def __init__(
        self,
        t_warmup: TimeInput,
        power: float = 2.0,
        t_max: TimeInput = "1dur",
        alpha_f: float = 0.0,
        scale_warmup: bool = False,
    ) -> None:
        super().__init__(t_warmup, t_max, scale_warmup)
        self.power = _number(type(self).__name__, "power", power)
        self.alpha_f = _number(type(self).__name__, "alpha_f", alpha_f)

    def __call__(self, state: SchedulerState, ssr: float = 1.0) -> float:
        warming, x = self._phase(state, ssr)
        return x if warming else _polynomial(x, self.power, self.alpha_f)


# --- applying schedules to optimizers -----------------------------------------------------------


class LRSchedule:
    """Applies our schedulers to optimizers: ``lr = initial_lr * product(scheduler(state, ssr))`` per param group.

    The trainer calls :meth:`apply` at the start of every batch, before its forward pass, so batch ``k`` trains
    with the multiplier for ``timestamp.batch == k``. Several schedulers multiply. ``initial_lr`` is recorded per
    param group the first time the group is seen, at construction or, for groups added later with
    ``add_param_group``, at the next :meth:`apply`. Its lr at that moment is the base lr. :meth:`state_dict` holds
    these base lrs, so a resume (where the optimizer's saved lr is already scaled) continues exactly.

    Only the schedulers defined here, or any callable matching :class:`Scheduler`, are handled. PyTorch
    ``LRScheduler`` objects are stepped by the trainer separately and are refused here.
    """

    def __init__(
        self,
        schedulers: Scheduler | Sequence[Scheduler],
        optimizers: Optimizer | Sequence[Optimizer],
        *,
        scale_schedule_ratio: float = 1.0,
    ) -> None:
        self.schedulers: list[Scheduler] = list(schedulers) if isinstance(schedulers, Sequence) else [schedulers]
        for scheduler in self.schedulers:
            if isinstance(scheduler, LRScheduler):
                raise TypeError(
                    f"LRSchedule handles fabric.trainer.schedulers, not PyTorch's {type(scheduler).__name__}; "
                    "the trainer steps PyTorch LR schedulers itself."
                )
            if not callable(scheduler):
                raise TypeError(f"A scheduler must be callable as scheduler(state, ssr), got {scheduler!r}.")
        self.optimizers: list[Optimizer] = list(optimizers) if isinstance(optimizers, Sequence) else [optimizers]
        for optimizer in self.optimizers:
            if not isinstance(optimizer, Optimizer):
                raise TypeError(f"Expected torch.optim.Optimizer objects, got {type(optimizer).__name__}.")
        _check_ssr(scale_schedule_ratio)
        self.scale_schedule_ratio = float(scale_schedule_ratio)
        self._initial_lrs: list[list[float]] = [[] for _ in self.optimizers]
        self._record_new_groups()

    def times_in_tokens(self) -> list[str]:
        """The schedulers' arguments given in tokens (``"LinearWithWarmupScheduler t_warmup='100tok'"``): they
        only move if tokens are counted."""
        found = []
        for scheduler in self.schedulers:
            if isinstance(scheduler, _TimeScheduler):
                for name, value in scheduler.arguments().items():
                    times = value if isinstance(value, list) else [value]
                    if any(isinstance(time, Time) and time.unit is TimeUnit.TOKEN for time in times):
                        found.append(f"{type(scheduler).__name__} {name}={_show(value)}")
        return found

    @property
    def initial_lrs(self) -> list[list[float]]:
        """The base lr of every param group, per optimizer (a copy)."""
        return [list(lrs) for lrs in self._initial_lrs]

    def _record_new_groups(self) -> None:
        for optimizer, lrs in zip(self.optimizers, self._initial_lrs, strict=True):
            lrs.extend(float(group["lr"]) for group in optimizer.param_groups[len(lrs) :])

    def multiplier(self, state: SchedulerState) -> float:
        """The product of every scheduler's multiplier at ``state``; it must be finite and non-negative."""
        product = 1.0
        for scheduler in self.schedulers:
            value = float(scheduler(state, self.scale_schedule_ratio))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{scheduler!r} returned the LR multiplier {value!r}; it must be finite and >= 0.")
            product *= value
        return product

    def apply(self, state: SchedulerState) -> float:
        """Set every param group's lr for the batch about to run; returns the multiplier used."""
        self._record_new_groups()
        factor = self.multiplier(state)
        for optimizer, lrs in zip(self.optimizers, self._initial_lrs, strict=True):
            for group, initial_lr in zip(optimizer.param_groups, lrs, strict=True):
                lr = initial_lr * factor
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)  # tensor lrs (e.g. capturable optimizers) must change in place
                else:
                    group["lr"] = lr
        return factor

    def state_dict(self) -> dict[str, list[list[float]]]:
        """The base lrs as plain floats, safe for ``torch.load(weights_only=True)``."""
        return {"initial_lrs": self.initial_lrs}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the base lrs from :meth:`state_dict`; the optimizers must have at least that many groups."""
        saved = state_dict.get("initial_lrs") if isinstance(state_dict, Mapping) else None
        if not isinstance(saved, Sequence) or len(saved) != len(self.optimizers):
            raise ValueError(
                f"Not an LRSchedule state dict for {len(self.optimizers)} optimizer(s): expected "
                f"{{'initial_lrs': [[float, ...] per optimizer]}}, got {state_dict!r}."
            )
        restored: list[list[float]] = []
        for index, (optimizer, lrs) in enumerate(zip(self.optimizers, saved, strict=True)):
            if not isinstance(lrs, Sequence) or len(lrs) > len(optimizer.param_groups):
                raise ValueError(
                    f"LRSchedule state for optimizer {index} has {lrs!r}, which does not fit its "
                    f"{len(optimizer.param_groups)} param group(s)."
                )
            values = []
            for lr in lrs:
                if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not math.isfinite(lr):
                    raise ValueError(f"LRSchedule state for optimizer {index}: {lr!r} is not a finite lr.")
                values.append(float(lr))
            restored.append(values)
        self._initial_lrs = restored
