"""Gradient clipping: bound the gradients before the optimizer step, by total norm, by value, or adaptively (AGC).

* ``"norm"``: rescale all gradients together so their total L2 norm is at most ``clipping_threshold``.
* ``"value"``: clamp every gradient entry to ``[-clipping_threshold, clipping_threshold]``.
* ``"adaptive"``: Adaptive Gradient Clipping from "High-Performance Large-Scale Image Recognition Without
  Normalization" (Brock et al., 2021): per unit (a row of a weight: an output neuron or filter; a whole bias),
  rescale the gradient ``G`` so that ``||G|| <= clipping_threshold * max(||W||, 1e-3)``.

Event: ``AFTER_TRAIN_BATCH``, when the gradients of the whole batch are complete, already all-reduced across
ranks and already unscaled when a GradScaler is used, and the optimizer has not stepped yet. The clipping
therefore uses ``torch.nn.utils`` directly and never unscales again. Under DeepSpeed the gradients live inside its
engine, which clips them itself: ``INIT`` refuses the combination, naming the config key to use instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from typing_extensions import override

from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.utilities.grad_norm import clip_grad_norm_

CLIPPING_TYPES = ("norm", "value", "adaptive")
#: AGC's floor on a unit's weight norm, so freshly zero-initialised units can still move (Brock et al.).
AGC_WEIGHT_EPSILON = 1e-3


def _check_clipping(clipping_type: str, clipping_threshold: float) -> None:
    if clipping_type not in CLIPPING_TYPES:
        raise ValueError(f"clipping_type={clipping_type!r} is not supported; use one of {', '.join(CLIPPING_TYPES)}.")
    threshold = clipping_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise ValueError(f"clipping_threshold={clipping_threshold!r} must be a finite number greater than 0.")
    if threshold <= 0:
        raise ValueError(f"clipping_threshold={clipping_threshold!r} must be a finite number greater than 0.")


def unitwise_norm(tensor: torch.Tensor) -> torch.Tensor:
    """L2 norm per unit: over everything but dim 0 for weights (kept broadcastable), over the whole of a vector."""
    dims = None if tensor.ndim <= 1 else tuple(range(1, tensor.ndim))
    norm: torch.Tensor = torch.linalg.vector_norm(tensor, dim=dims, keepdim=tensor.ndim > 1)
    return norm


@torch.no_grad()
def adaptive_clip_grad_(parameters: Iterable[torch.Tensor], clipping_threshold: float) -> None:
    """AGC in place: scale each unit's gradient down to ``clipping_threshold * max(||W_unit||, 1e-3)`` if above."""
    for parameter in parameters:
        if parameter.grad is None:
            continue
        max_norm = unitwise_norm(parameter).clamp(min=AGC_WEIGHT_EPSILON) * clipping_threshold
        grad_norm = unitwise_norm(parameter.grad)
        scale = torch.where(grad_norm > max_norm, max_norm / grad_norm.clamp(min=1e-12), torch.ones_like(grad_norm))
        parameter.grad.mul_(scale)


def apply_gradient_clipping(
    parameters: nn.Module | Iterable[torch.Tensor], clipping_type: str, clipping_threshold: float
) -> None:
    """Clip the gradients of ``parameters`` (a module or tensors) in place; see the module docstring."""
    _check_clipping(clipping_type, clipping_threshold)
    tensors = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    if clipping_type == "norm":
        clip_grad_norm_(tensors, max_norm=clipping_threshold)  # tensor-parallel and FSDP-only DTensors together
    elif clipping_type == "value":
        torch.nn.utils.clip_grad_value_(tensors, clip_value=clipping_threshold)
    else:
        adaptive_clip_grad_(tensors, clipping_threshold)


class GradientClipping(Algorithm):
    """Gradient clipping (see the module docstring)."""

    def __init__(self, clipping_type: str, clipping_threshold: float) -> None:
        _check_clipping(clipping_type, clipping_threshold)
        self.clipping_type, self.clipping_threshold = clipping_type, float(clipping_threshold)

    @override
    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_TRAIN_BATCH or event is Event.INIT

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event is Event.INIT:
            if state.fabric is not None and state.fabric.strategy.engine_handles_gradients:
                raise ValueError(
                    f"{self!r} cannot clip under DeepSpeed, whose engine holds the gradients: remove it and set "
                    f"'gradient_clipping': {self.clipping_threshold} (a norm) in the DeepSpeed config instead."
                )
            return
        apply_gradient_clipping(state.model, self.clipping_type, self.clipping_threshold)

    def __repr__(self) -> str:
        return f"GradientClipping(clipping_type={self.clipping_type!r}, clipping_threshold={self.clipping_threshold})"
