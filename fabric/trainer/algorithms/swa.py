"""SWA: average the weights visited late in training, and finish with that average.

From ``swa_start`` on, every ``update_interval`` the current weights are added to an equal-weight running
average (``torch.optim.swa_utils.AveragedModel``). At ``swa_end`` the BatchNorm statistics of the averaged model
are recomputed over the training dataloader (``update_bn``) and the model's weights and buffers are replaced by
the average. The average of points along the trajectory of SGD lies in a flatter region of the loss and
generalises better. From "Averaging Weights Leads to Wider Optima and Better Generalization" (Izmailov et al.,
UAI 2018).

Events: the average is updated at ``BATCH_END`` (``update_interval`` in ``ba``) or ``EPOCH_END`` (in ``ep``). With
``swa_lr`` set, SWA takes over the learning rate from ``swa_start`` until ``swa_end``: at every
``BEFORE_TRAIN_BATCH`` (after the trainer's schedule set the batch's LR) a ``SWALR`` per optimizer anneals every
param group from the LR at ``swa_start`` to ``swa_lr`` over ``anneal_steps`` batches (``anneal_strategy``
``"linear"`` or ``"cos"``) and holds it there. Training after ``swa_end`` (if any) continues from the averaged
weights with the trainer's schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from typing_extensions import override

from fabric.trainer.algorithms.ema import model_tensors, time_reached
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, TimeUnit
from fabric.wrappers import FabricModule

_ANNEAL_STRATEGIES = ("linear", "cos")


def _user_module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, FabricModule) else model


def _whole_batches(dataloader: Iterable[Any]) -> Iterator[tuple[Any]]:
    """``update_bn`` feeds ``item[0]`` of list/tuple items to the model; wrapping each batch in a 1-tuple hands the
    model the whole batch, as this trainer's ``forward(batch)`` expects."""
    for batch in dataloader:
        yield (batch,)


class SWA(Algorithm):
    """SWA (see the module docstring)."""

    # Two would each load their own average into the one model at the end.
    allow_multiple_instances: ClassVar[bool] = False

    def __init__(
        self,
        swa_start: Time[Any] | str = "0.7dur",
        swa_end: Time[Any] | str = "0.97dur",
        swa_lr: float | None = None,
        update_interval: Time[Any] | str = "1ep",
        anneal_steps: int = 10,
        anneal_strategy: str = "linear",
    ) -> None:
        self.swa_start, self.swa_end = Time.from_input(swa_start), Time.from_input(swa_end)
        if self.swa_start.unit is not self.swa_end.unit or not self.swa_start < self.swa_end:
            raise ValueError(f"SWA: swa_start={swa_start!r} must come before swa_end={swa_end!r}, in the same unit.")
        self.update_interval = Time.from_input(update_interval)
        if self.update_interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or self.update_interval.value < 1:
            raise ValueError(f"SWA: update_interval={update_interval!r} must be a positive count in 'ba' or 'ep'.")
        if swa_lr is not None and (isinstance(swa_lr, bool) or not isinstance(swa_lr, int | float) or swa_lr <= 0):
            raise ValueError(f"SWA: swa_lr={swa_lr!r} must be a positive number or None (keep the trainer's LR).")
        if anneal_strategy not in _ANNEAL_STRATEGIES:
            raise ValueError(f"SWA: anneal_strategy={anneal_strategy!r}; use one of {', '.join(_ANNEAL_STRATEGIES)}.")
        if isinstance(anneal_steps, bool) or not isinstance(anneal_steps, int) or anneal_steps < 0:
            raise ValueError(f"SWA: anneal_steps={anneal_steps!r} must be a non-negative int.")
        self.swa_lr, self.anneal_steps, self.anneal_strategy = swa_lr, anneal_steps, anneal_strategy
        self._update_event = Event.BATCH_END if self.update_interval.unit is TimeUnit.BATCH else Event.EPOCH_END
        self.averaged_model: AveragedModel | None = None
        self.swa_schedulers: list[SWALR] = []
        self.completed = False
        self._resumed_average: dict[str, Any] | None = None

    @override
    def match(self, event: Event, state: State) -> bool:
        if self.completed or not time_reached(state, self.swa_start):
            return False
        if event is Event.BEFORE_TRAIN_BATCH:
            return self.swa_lr is not None
        if event is not self._update_event:
            return False
        return int(state.timestamp.get(self.update_interval.unit)) % int(self.update_interval.value) == 0

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event is Event.BEFORE_TRAIN_BATCH:
            self._set_swa_lr(state)
            return
        model = _user_module(state.model)
        if self.averaged_model is None:
            self.averaged_model = AveragedModel(model, use_buffers=False)
            if self._resumed_average is not None:
                self.averaged_model.load_state_dict(self._resumed_average)
                self._resumed_average = None
        if time_reached(state, self.swa_end):
            self._finish(state, model)
        else:
            self.averaged_model.update_parameters(model)

    def _set_swa_lr(self, state: State) -> None:
        """Anneal to ``swa_lr`` with one SWALR step per batch, overriding what the trainer's schedule set this batch."""
        if not self.swa_schedulers:  # SWALR's constructor takes its first step from the current learning rate
            self.swa_schedulers = [
                SWALR(optimizer, self.swa_lr, self.anneal_steps, self.anneal_strategy)  # type: ignore[arg-type]
                for optimizer in state.optimizers
            ]
            return
        for scheduler in self.swa_schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
            scheduler.step()

    @torch.no_grad()
    def _finish(self, state: State, model: nn.Module) -> None:
        assert self.averaged_model is not None
        if state.dataloader is not None:
            update_bn(_whole_batches(state.dataloader), self.averaged_model.module)
        for tensor, average in zip(model_tensors(model), model_tensors(self.averaged_model.module), strict=True):
            tensor.copy_(average)
        self.completed = True

    @override
    def state_dict(self) -> dict[str, Any]:
        averaged = None if self.averaged_model is None else self.averaged_model.state_dict()
        return {"averaged_model": averaged, "completed": self.completed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.completed = state_dict["completed"]
        self._resumed_average = state_dict["averaged_model"]  # loaded into the AveragedModel built at the next update

    def __repr__(self) -> str:
        return f"SWA(swa_start={self.swa_start}, swa_end={self.swa_end}, swa_lr={self.swa_lr})"
