"""EMA: keep an exponential moving average of the weights and evaluate with it.

After every update interval, ``ema = smoothing * ema + (1 - smoothing) * weights`` for every parameter and
floating-point buffer (integer buffers such as BatchNorm's batch counter are copied). ``smoothing`` is given
directly or as a half-life: ``smoothing = 0.5 ** (update_interval / half_life)``, so a weight's influence halves
every ``half_life``. Averaged weights generalise better and are less noisy than the last iterate. From
"Acceleration of Stochastic Approximation by Averaging" (Polyak & Juditsky, 1992); used as in Composer.

Events: the average is started (a copy of the weights) at the first update at or after ``ema_start`` and updated
at ``BATCH_END`` (``update_interval`` in ``ba``) or ``EPOCH_END`` (in ``ep``), whenever the count is a multiple of
the interval. Evaluation uses the average: it is swapped into the model at ``EVAL_BEFORE_ALL`` and swapped out at
``EVAL_AFTER_ALL`` (``EVAL_STANDALONE_START``/``END`` for ``Trainer.eval()``), so training continues on the raw
weights. The model is left holding the raw weights at the end of training; :meth:`EMA.copy_to` puts the
average into a model.

Checkpoints: a weights-only checkpoint (``save_weights_only=True`` or ``trainer.save_checkpoint(path,
weights_only=True)``: the model to deploy) holds the average, swapped in only while it is written
(:meth:`EMA.exported_weights`). A full checkpoint holds the raw weights plus :meth:`state_dict` (the average), so a
resumed run continues both exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, TimeUnit

_INTERVAL_UNITS = (TimeUnit.BATCH, TimeUnit.EPOCH)
_EVAL_ROUND_OPENINGS = (Event.EVAL_BEFORE_ALL, Event.EVAL_STANDALONE_START)
_EVAL_ROUND_EVENTS = (*_EVAL_ROUND_OPENINGS, Event.EVAL_AFTER_ALL, Event.EVAL_STANDALONE_END)


def time_reached(state: State, time: Time[Any]) -> bool:
    """Whether training has reached ``time`` (a ``dur`` fraction of ``max_duration``, or a count in any unit)."""
    if time.unit is TimeUnit.DURATION:
        return float(state.get_elapsed_duration()) >= float(time.value)
    return bool(state.timestamp.get(time.unit) >= time)


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The parameters then the buffers of ``model``: what a weight average covers."""
    return [*model.parameters(), *model.buffers()]


@torch.no_grad()
def _average_into(averages: list[torch.Tensor], tensors: list[torch.Tensor], smoothing: float) -> None:
    for average, tensor in zip(averages, tensors, strict=True):
        if average.is_floating_point():
            average.mul_(smoothing).add_(tensor.detach(), alpha=1.0 - smoothing)
        else:
            average.copy_(tensor)


def compute_ema(model: nn.Module, ema_model: nn.Module, smoothing: float) -> None:
    """Update ``ema_model`` (same architecture) in place: ``ema = smoothing * ema + (1 - smoothing) * model``."""
    if not 0 <= smoothing <= 1:
        raise ValueError(f"compute_ema: smoothing={smoothing!r} must be in [0, 1].")
    _average_into(model_tensors(ema_model), model_tensors(model), smoothing)


def _interval(value: Time[Any] | str | int) -> Time[Any]:
    interval = Time.from_input(value, TimeUnit.BATCH)
    if interval.unit not in _INTERVAL_UNITS or interval.value < 1:
        raise ValueError(f"EMA: update_interval={value!r} must be a positive count in 'ba' or 'ep', e.g. '1ba'.")
    return interval


def _smoothing(half_life: Time[Any] | str | None, smoothing: float | None, interval: Time[Any]) -> float:
    if (half_life is None) == (smoothing is None):
        raise ValueError(
            f"EMA needs exactly one of half_life or smoothing, got half_life={half_life!r}, smoothing={smoothing!r} "
            "(pass half_life=None to use smoothing)."
        )
    if smoothing is not None:
        if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 <= smoothing < 1:
            raise ValueError(f"EMA: smoothing={smoothing!r} must be in [0, 1).")
        return float(smoothing)
    life = Time.from_input(half_life, TimeUnit.BATCH)  # type: ignore[arg-type]
    if life.unit is not interval.unit or life.value <= 0:
        raise ValueError(
            f"EMA: half_life={half_life!r} must be positive and in the unit of update_interval ({interval})."
        )
    return float(0.5 ** (interval.value / life.value))


class EMA(Algorithm):
    """EMA (see the module docstring)."""

    # Two would each swap their own averaged weights into the one model for evaluation.
    allow_multiple_instances: ClassVar[bool] = False

    def __init__(
        self,
        half_life: Time[Any] | str | None = "1000ba",
        smoothing: float | None = None,
        ema_start: Time[Any] | str = "0.0dur",
        update_interval: Time[Any] | str | int = "1ba",
    ) -> None:
        self.update_interval = _interval(update_interval)
        self.smoothing = _smoothing(half_life, smoothing, self.update_interval)
        self.ema_start = Time.from_input(ema_start)
        self._update_event = Event.BATCH_END if self.update_interval.unit is TimeUnit.BATCH else Event.EPOCH_END
        self.averages: list[torch.Tensor] | None = None
        self._swapped = False

    @override
    def match(self, event: Event, state: State) -> bool:
        if event is self._update_event:
            count = int(state.timestamp.get(self.update_interval.unit))
            return count % int(self.update_interval.value) == 0 and time_reached(state, self.ema_start)
        return event in _EVAL_ROUND_EVENTS and self.averages is not None

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        tensors = self._model_tensors(state)
        if event is self._update_event:
            if self.averages is None:
                self.averages = [tensor.detach().clone() for tensor in tensors]
            else:
                _average_into(self.averages, tensors, self.smoothing)
        elif (event in _EVAL_ROUND_OPENINGS) != self._swapped:
            self._swap(tensors)

    @contextmanager
    @override
    def exported_weights(self, state: State) -> Iterator[None]:
        """The model holds the average inside (once averaging started): what a weights-only checkpoint saves."""
        swap = self.averages is not None and not self._swapped  # during evaluation it holds the average already
        if swap:
            self._swap(self._model_tensors(state))
        try:
            yield
        finally:
            if swap:
                self._swap(self._model_tensors(state))

    def _model_tensors(self, state: State) -> list[torch.Tensor]:
        """The model's tensors, with the average moved to their device first (it loads onto the CPU)."""
        tensors = model_tensors(state.model)
        if self.averages is not None and self.averages[0].device != tensors[0].device:
            self.averages = [average.to(tensor.device) for average, tensor in zip(self.averages, tensors, strict=True)]
        return tensors

    @torch.no_grad()
    def _swap(self, tensors: list[torch.Tensor]) -> None:
        assert self.averages is not None
        for average, tensor in zip(self.averages, tensors, strict=True):
            held = tensor.detach().clone()
            tensor.copy_(average)
            average.copy_(held)
        self._swapped = not self._swapped

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Load the averaged weights into ``model`` (e.g. the trained model, to deploy the average)."""
        if self.averages is None:
            raise RuntimeError("EMA has not started averaging yet (ema_start not reached); nothing to copy.")
        for average, tensor in zip(self.averages, model_tensors(model), strict=True):
            tensor.copy_(average)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"averages": None if self.averages is None else [a.clone() for a in self.averages]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        averages = state_dict["averages"]
        self.averages = None if averages is None else [average.clone() for average in averages]
        self._swapped = False

    def __repr__(self) -> str:
        return f"EMA(smoothing={self.smoothing}, ema_start={self.ema_start}, update_interval={self.update_interval})"
