"""Layer freezing: stop training the earliest layers progressively, as they converge first, to save compute.

From ``freeze_start`` (a fraction of training) on, the share of frozen layers grows linearly to ``freeze_level``
at the end of training: ``freeze_level * (elapsed - freeze_start) / (1 - freeze_start)``. Layers are the modules
that own parameters directly, in registration order (the input side first). A frozen layer's parameters get
``requires_grad=False`` and no gradient, and every optimizer drops their state (moments etc.), so they stop
changing (PyTorch optimizers skip parameters without a gradient, weight decay included) and cost no
weight-gradient work. They stay listed in the param groups, so an optimizer checkpoint keeps its shape and a
run resumes; the algorithm's state (how many layers are frozen) re-freezes them on load. From "FreezeOut:
Accelerate Training by Progressively Freezing Layers" (Brock et al., 2017); schedule as in Composer.

Events: ``EPOCH_END`` (``interval="epoch"``, as Composer) or ``BATCH_END`` (``interval="batch"``). Freezing is
never undone. Under DDP, parameters that stop receiving gradients need ``find_unused_parameters=True`` on the
DDP wrapper (otherwise it waits for their gradients), as with any mid-training change of ``requires_grad``; this
combination is not tested here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State

_INTERVAL_EVENTS = {"epoch": Event.EPOCH_END, "batch": Event.BATCH_END}


def _check_fraction(name: str, value: float, upper_inclusive: bool) -> float:
    upper_ok = value <= 1 if upper_inclusive else value < 1
    if isinstance(value, bool) or not isinstance(value, int | float) or not (value >= 0 and upper_ok):
        raise ValueError(f"LayerFreezing: {name}={value!r} must be in [0, 1{']' if upper_inclusive else ')'}.")
    return float(value)


def freeze_fraction(elapsed: float, freeze_start: float, freeze_level: float) -> float:
    """The share of layers frozen after ``elapsed`` (fraction of training)."""
    progress = min(max((elapsed - freeze_start) / (1.0 - freeze_start), 0.0), 1.0)
    return freeze_level * progress


def parameter_layers(model: nn.Module) -> list[nn.Module]:
    """Modules that own parameters themselves, in registration order."""
    return [module for module in model.modules() if any(True for _ in module.parameters(recurse=False))]


def freeze_layers(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    elapsed: float,
    freeze_start: float = 0.5,
    freeze_level: float = 1.0,
) -> int:
    """Freeze the first layers of ``model`` due after ``elapsed`` of training; returns how many are frozen."""
    count = int(freeze_fraction(elapsed, freeze_start, freeze_level) * len(parameter_layers(model)))
    freeze_first_layers(model, optimizers, count)
    return count


def freeze_first_layers(model: nn.Module, optimizers: Sequence[Optimizer], count: int) -> None:
    """Freeze the first ``count`` parameter layers: no gradient, no optimizer state (they stay in the groups)."""
    frozen = [parameter for layer in parameter_layers(model)[:count] for parameter in layer.parameters(recurse=False)]
    for parameter in frozen:
        parameter.requires_grad_(False)
        parameter.grad = None
    frozen_ids = {id(parameter) for parameter in frozen}
    for optimizer in optimizers:
        for stale in [p for p in optimizer.state if id(p) in frozen_ids]:
            del optimizer.state[stale]


class LayerFreezing(Algorithm):
    """Layer freezing (see the module docstring)."""

    def __init__(self, freeze_start: float = 0.5, freeze_level: float = 1.0, interval: str = "epoch") -> None:
        self.freeze_start = _check_fraction("freeze_start", freeze_start, upper_inclusive=False)
        self.freeze_level = _check_fraction("freeze_level", freeze_level, upper_inclusive=True)
        if interval not in _INTERVAL_EVENTS:
            raise ValueError(f"LayerFreezing: interval={interval!r}; use one of {', '.join(_INTERVAL_EVENTS)}.")
        self.interval = interval
        self.frozen_layers = 0
        self._state: State | None = None

    @override
    def match(self, event: Event, state: State) -> bool:
        if event is Event.INIT:  # remember the state, so a checkpoint's freezing can be re-applied on load
            self._state = state
        return event is _INTERVAL_EVENTS[self.interval]

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        elapsed = float(state.get_elapsed_duration())
        self.frozen_layers = freeze_layers(state.model, state.optimizers, elapsed, self.freeze_start, self.freeze_level)
        if logger is not None:
            logger.log_metrics({"layer_freezing/frozen_layers": self.frozen_layers})

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"frozen_layers": self.frozen_layers}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.frozen_layers = int(state_dict["frozen_layers"])
        if self._state is not None:
            freeze_first_layers(self._state.model, self._state.optimizers, self.frozen_layers)

    def __repr__(self) -> str:
        return f"LayerFreezing(freeze_start={self.freeze_start}, freeze_level={self.freeze_level})"
