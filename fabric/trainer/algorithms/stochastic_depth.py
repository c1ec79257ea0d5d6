"""StochasticDepth: randomly skip the residual branch of residual blocks during training.

A residual block computes ``shortcut(x) + f(x)``. Dropping ``f`` for a whole batch with probability
``p`` trains an implicit ensemble of shallower networks, shortens the expected depth (faster steps)
and regularises; at evaluation ``f`` is kept and scaled by its survival probability ``1 - p``, so the
expected output is unchanged (Huang et al., "Deep Networks with Stochastic Depth", ECCV 2016).

What the user names: the residual-block class (``target_layer``: the class, or its name or dotted
path as a string) and the attribute holding its residual branch (``branch_attribute``), i.e. the
submodule ``f`` whose output the block's ``forward`` adds to the shortcut, such as ``self.branch`` in
``return x + self.branch(x)`` or ``return self.shortcut(x) + self.branch(x)``. That submodule is wrapped
in a :class:`DroppableBranch`; the block's own code is untouched. A dropped branch outputs zeros of its
usual output shape, remembered per input shape, so it is not computed (only a first drop for a new
input shape runs it once, without gradients, to learn that shape).

Drop rates: ``drop_distribution="uniform"`` gives every block ``drop_rate``; ``"linear"`` (the paper's
rule) gives the ``l``-th of ``L`` blocks (in module order) ``drop_rate * l / L``, so early blocks,
whose features everything else builds on, are rarely dropped. ``drop_warmup`` (a time such as
``"0.1dur"`` or ``"500ba"``) ramps every rate linearly from 0 during that part of training.

Fires at ``Event.INIT`` (wrapping) and, with a warmup, at every ``Event.BATCH_START`` (rates). Each
block draws from torch's global generator per forward. A dropped branch's parameters get no gradient
in that step, so DDP needs ``find_unused_parameters=True``. The rate in force is part of the state dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.core.time import Time, TimeUnit, elapsed_fraction
from fabric.trainer.surgery import SurgeryAlgorithm

DROP_DISTRIBUTIONS = ("linear", "uniform")


class DroppableBranch(nn.Module):
    """A residual branch dropped with probability ``drop_rate`` in training and scaled by ``1 - drop_rate`` in eval."""

    def __init__(self, branch: nn.Module, drop_rate: float) -> None:
        super().__init__()
        self.branch = branch
        #: The rate after warmup; ``drop_rate`` is the one in force now.
        self.target_drop_rate = drop_rate
        self.drop_rate = drop_rate
        self._output_shapes: dict[tuple[torch.Size, torch.dtype], torch.Size] = {}

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            scaled: torch.Tensor = self.branch(input) * (1.0 - self.drop_rate)
            return scaled
        key = (input.shape, input.dtype)
        if self.drop_rate > 0 and bool(torch.rand(()) < self.drop_rate):
            if key not in self._output_shapes:
                with torch.no_grad():
                    self._output_shapes[key] = self.branch(input).shape
            return input.new_zeros(self._output_shapes[key])
        output: torch.Tensor = self.branch(input)
        self._output_shapes[key] = output.shape
        return output

    @override
    def get_extra_state(self) -> dict[str, float]:
        """The rate in force goes into the state dict, so a checkpoint taken during warmup reloads exactly."""
        return {"drop_rate": self.drop_rate}

    @override
    def set_extra_state(self, state: dict[str, float]) -> None:
        self.drop_rate = float(state["drop_rate"])

    @override
    def extra_repr(self) -> str:
        return f"drop_rate={self.drop_rate:g}, target_drop_rate={self.target_drop_rate:g}"


def _class_path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_target(module: nn.Module, target_layer: type[nn.Module] | str) -> bool:
    if isinstance(target_layer, str):
        return target_layer in (type(module).__name__, _class_path(type(module)))
    return isinstance(module, target_layer)


def _check_rate(drop_rate: float, drop_distribution: str) -> None:
    if isinstance(drop_rate, bool) or not isinstance(drop_rate, int | float) or not 0 <= drop_rate <= 1:
        raise ValueError(f"drop_rate must be a probability in [0, 1], got {drop_rate!r}.")
    if drop_distribution not in DROP_DISTRIBUTIONS:
        raise ValueError(f"drop_distribution must be one of {DROP_DISTRIBUTIONS}, got {drop_distribution!r}.")


def apply_stochastic_depth(
    model: nn.Module,
    target_layer: type[nn.Module] | str,
    branch_attribute: str,
    drop_rate: float = 0.2,
    drop_distribution: str = "linear",
) -> list[DroppableBranch]:
    """Wrap the residual branch of every ``target_layer`` block of ``model`` in place; returns the wrappers.

    Raises ``ValueError`` when no block matches or a block has no module ``branch_attribute``. The
    branches keep their parameters, so optimizers need no update.
    """
    _check_rate(drop_rate, drop_distribution)
    blocks = [module for module in model.modules() if _is_target(module, target_layer)]
    if not blocks:
        name = target_layer if isinstance(target_layer, str) else _class_path(target_layer)
        present = sorted({type(module).__name__ for module in model.modules()})
        raise ValueError(f"StochasticDepth found no {name!r} block in the model; its module classes are {present}.")
    wrappers = []
    for index, block in enumerate(blocks, start=1):
        branch = getattr(block, branch_attribute, None)
        if not isinstance(branch, nn.Module):
            children = [name for name, _ in block.named_children()]
            raise ValueError(
                f"{type(block).__name__} has no submodule {branch_attribute!r} to use as its residual branch; "
                f"its submodules are {children}."
            )
        if isinstance(branch, DroppableBranch):
            raise ValueError(f"The {branch_attribute!r} branch of {type(block).__name__} is already droppable.")
        rate = drop_rate * index / len(blocks) if drop_distribution == "linear" else drop_rate
        wrapper = DroppableBranch(branch, rate)
        block.register_module(branch_attribute, wrapper)
        wrappers.append(wrapper)
    return wrappers


class StochasticDepth(SurgeryAlgorithm):
    """Stochastic depth on the residual blocks the user names (see the module docstring)."""

    def __init__(
        self,
        target_layer: type[nn.Module] | str,
        branch_attribute: str,
        drop_rate: float = 0.2,
        drop_distribution: str = "linear",
        drop_warmup: str | Time[Any] = "0.0dur",
    ) -> None:
        if not (isinstance(target_layer, str) and target_layer) and not (
            isinstance(target_layer, type) and issubclass(target_layer, nn.Module)
        ):
            raise ValueError(f"target_layer must be an nn.Module subclass or its name, got {target_layer!r}.")
        if not (isinstance(branch_attribute, str) and branch_attribute.isidentifier()):
            raise ValueError(f"branch_attribute must be an attribute name, got {branch_attribute!r}.")
        _check_rate(drop_rate, drop_distribution)
        self.drop_warmup = Time.from_input(drop_warmup, TimeUnit.DURATION)
        self.target_layer = target_layer if isinstance(target_layer, str) else _class_path(target_layer)
        self._target_class = target_layer
        self.branch_attribute, self.drop_rate, self.drop_distribution = branch_attribute, drop_rate, drop_distribution
        self.branches: list[DroppableBranch] = []

    @override
    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT or (event == Event.BATCH_START and self.drop_warmup.value > 0)

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            super().apply(event, state, logger)
        else:
            self.set_warmup_progress(self._warmup_progress(state))

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        self.branches = apply_stochastic_depth(
            model, self._target_class, self.branch_attribute, self.drop_rate, self.drop_distribution
        )
        if self.drop_warmup.value > 0:
            self.set_warmup_progress(0.0)

    def set_warmup_progress(self, progress: float) -> None:
        """Set every branch's rate to ``min(progress, 1)`` times its target rate."""
        for branch in self.branches:
            branch.drop_rate = branch.target_drop_rate * min(progress, 1.0)

    def _warmup_progress(self, state: State) -> float:
        if self.drop_warmup.unit is TimeUnit.DURATION:
            return float(state.get_elapsed_duration()) / float(self.drop_warmup.value)
        return elapsed_fraction(state.timestamp, self.drop_warmup)

    @override
    def hparams(self) -> dict[str, Any]:
        return {
            "target_layer": self.target_layer,
            "branch_attribute": self.branch_attribute,
            "drop_rate": self.drop_rate,
            "drop_distribution": self.drop_distribution,
            "drop_warmup": str(self.drop_warmup),
        }
