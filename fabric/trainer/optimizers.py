"""Composer's optimizers with decoupled weight decay: ``DecoupledSGDW`` (the Trainer's default) and ``DecoupledAdamW``.

Weight decay is decoupled from the gradient step (Loshchilov and Hutter) and follows the learning-rate
schedule: each step multiplies every parameter by ``1 - weight_decay * lr / initial_lr``, where ``initial_lr``
is the group's learning rate when the optimizer was built. So ``weight_decay`` is the decay per step at the
schedule's peak, whatever the learning rate's size, and a schedule that lowers the learning rate lowers the
decay with it. (``torch.optim.AdamW`` multiplies by ``1 - lr * weight_decay`` instead, tying the decay to the
learning rate's size.) The gradient step is torch's own ``SGD``/``Adam`` step, without weight decay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import SGD, Adam
from typing_extensions import override

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


class _DecoupledStep(torch.optim.Optimizer):
    """The step both optimizers share: the schedule-scaled decay, then the torch optimizer's own step."""

    @torch.no_grad()
    @override
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _evaluate(closure)
        _decay_weights(self)
        super().step()
        return loss


class DecoupledSGDW(_DecoupledStep, SGD):
    """SGD (with momentum, dampening, Nesterov as ``torch.optim.SGD``) and decoupled, schedule-scaled weight decay."""

    def __init__(
        self,
        params: Params,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        _check_non_negative(type(self).__name__, lr=lr, weight_decay=weight_decay)
        super().__init__(
            params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
        )
        _decouple_weight_decay(self)


class DecoupledAdamW(_DecoupledStep, Adam):
    """Adam (``torch.optim.Adam``'s step, ``amsgrad`` included) and decoupled, schedule-scaled weight decay.

    Composer's defaults: ``lr=1e-3``, ``betas=(0.9, 0.95)``, ``eps=1e-8``, ``weight_decay=1e-5``.
    """

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 1e-5,
        amsgrad: bool = False,
    ) -> None:
        _check_non_negative(type(self).__name__, lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        _decouple_weight_decay(self)


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{owner}({name}={value!r}) is not valid. Accepted: a number >= 0.")


def _decouple_weight_decay(optimizer: torch.optim.Optimizer) -> None:
    """Move each group's ``weight_decay`` (a group's own, else the default) to ``decoupled_weight_decay`` and
    record its ``initial_lr``, both in the param group as Composer keeps them (they travel with ``state_dict``),
    so that torch's step, which reads ``weight_decay``, does not decay again. Groups added later get the
    default decay."""
    optimizer.defaults["decoupled_weight_decay"] = optimizer.defaults["weight_decay"]
    optimizer.defaults["weight_decay"] = 0.0
    for group in optimizer.param_groups:
        group["decoupled_weight_decay"] = group["weight_decay"]
        group["weight_decay"] = 0.0
        group.setdefault("initial_lr", group["lr"])


def _decay_weights(optimizer: torch.optim.Optimizer) -> None:
    """``p *= 1 - decay * lr / initial_lr`` for every parameter with a gradient."""
    for group in optimizer.param_groups:
        decay = group["decoupled_weight_decay"]
        initial_lr = group.setdefault("initial_lr", group["lr"])
        parameters = [parameter for parameter in group["params"] if parameter.grad is not None]
        if decay and parameters:
            torch._foreach_mul_(parameters, 1.0 - decay * (group["lr"] / initial_lr if initial_lr else 1.0))


def _evaluate(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
