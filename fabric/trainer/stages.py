"""What ``Trainer.fit()`` may change between training stages: optimizers, precision, schedulers, and the default
optimizer Composer trains with when none is given.

* **Optimizers** given to ``fit()`` replace the trainer's and are set up with ``fabric.setup_optimizers``: on one
  device and under DDP the model was set up once and its parameters are the ones a new optimizer holds; under FSDP
  (and ModelParallel) ``setup_optimizers`` points an optimizer built from the model's parameters, sharded or not, at
  the shards. Every parameter must be the model's. DeepSpeed builds one engine from the model and its first
  optimizer, so a new optimizer is refused there.
* **Time reset** (``reset_time=True``): the clock restarts at zero, so the Trainer's own intervals (evaluation,
  checkpoint saving), which remember the batch they last fired at, start afresh (:func:`restarted_interval`).
* **Precision** switches between ``"32-true"``, ``"16-mixed"`` and ``"bf16-mixed"`` (Composer's ``fp32``, ``amp_fp16``
  / ``amp``, ``amp_bf16``): all keep float32 parameters and differ only in the forward's autocast and the loss scaling,
  which the precision plugin applies per call. Only on one device or DDP: FSDP and ModelParallel cast parameters as
  the model was sharded with, DeepSpeed inside its engine. ``"*-true"`` precisions convert the model and are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fabric.trainer.core.time import Time, TimeUnit
from fabric.trainer.intervals import IntervalFunction, create_interval
from fabric.trainer.schedulers import LRSchedule
from fabric.utilities.rank_zero import rank_zero_warn
from fabric.wrappers import FabricOptimizer, unwrap_optimizer

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.plugins.precision.precision import Precision

#: Precisions with float32 parameters, between which a fit() may switch.
SWITCHABLE_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")


def default_optimizer(model: nn.Module) -> Optimizer | None:
    """Composer's default when no optimizer is given: ``DecoupledSGDW(model.parameters(), lr=0.1)``; None for a model
    without parameters. Say so with :func:`warn_default_optimizer` once the arguments are known to be valid."""
    from fabric.trainer.optimizers import DecoupledSGDW

    if not any(True for _ in model.parameters()):
        return None
    return DecoupledSGDW(model.parameters(), lr=0.1)


def warn_default_optimizer(optimizer: Optimizer | None) -> None:
    """The warning that :func:`default_optimizer` chose ``optimizer`` (or, for ``None``, none at all)."""
    if optimizer is None:
        rank_zero_warn("No optimizer was specified, and the model has no parameters: no optimizer is created.")
    else:
        rank_zero_warn(f"No optimizer was specified. Defaulting to {type(optimizer).__name__}(lr=0.1).")


def setup_new_optimizers(fabric: Fabric, model: nn.Module, optimizers: Any) -> list[Optimizer]:
    """``fit(optimizers=...)`` set up with ``fabric`` for the set-up ``model``; ``ValueError`` where impossible."""
    given = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not given:
        raise ValueError("fit(optimizers=[]) gives no optimizer; pass at least one, or leave optimizers out.")
    for optimizer in given:
        if not isinstance(optimizer, Optimizer):
            raise ValueError(
                f"fit(optimizers=...) holds a {type(optimizer).__name__}; expected torch.optim.Optimizer objects."
            )
    if fabric.strategy.engine_handles_gradients:
        raise ValueError(
            "fit(optimizers=...) cannot replace the optimizer under DeepSpeed: its engine was built from the model "
            "and the Trainer's optimizer together. Pass the optimizer to the Trainer, or use another Trainer."
        )
    # An optimizer already set up with Fabric (a FabricOptimizer, e.g. the Trainer's own) is taken as it is.
    set_up = [optimizer if _set_up_already(optimizer) else fabric.setup_optimizers(optimizer) for optimizer in given]
    own = {id(parameter) for parameter in model.parameters()}
    for optimizer in set_up:
        foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
        if foreign:
            raise ValueError(
                f"fit(optimizers=...): {type(unwrap_optimizer(optimizer)).__name__} holds {len(foreign)} parameter(s) "
                f"that are not the model's (the first of shape {tuple(foreign[0].shape)}). Build it from the "
                "parameters of the model given to the Trainer."
            )
    return set_up


def _set_up_already(optimizer: Optimizer) -> bool:
    return isinstance(optimizer, FabricOptimizer)


def check_schedulers_follow(torch_schedulers: Sequence[LRScheduler], optimizers: Sequence[Optimizer]) -> None:
    """PyTorch schedulers must step one of ``optimizers`` (the ones training after ``fit(optimizers=...)``)."""
    trained = {id(unwrap_optimizer(optimizer)) for optimizer in optimizers}
    stale = [s for s in torch_schedulers if id(unwrap_optimizer(s.optimizer)) not in trained]
    if stale:
        raise ValueError(
            f"{type(stale[0]).__name__} schedules an optimizer that fit(optimizers=...) replaces. Pass schedulers "
            "for the new optimizers with fit(schedulers=...), or fit(schedulers=[]) to train without them."
        )


def rebound_schedule(schedule: LRSchedule | None, optimizers: Sequence[Optimizer]) -> LRSchedule | None:
    """The same schedule functions applied to ``optimizers`` (whose learning rates become the base ones)."""
    if schedule is None:
        return None
    return LRSchedule(schedule.schedulers, list(optimizers), scale_schedule_ratio=schedule.scale_schedule_ratio)


def precision_for_fit(fabric: Fabric, precision: Any) -> Precision | None:
    """The precision plugin ``fit(precision=...)`` switches to, None when it is the current one; ``ValueError`` where
    a switch is impossible (see the module docstring)."""
    from fabric.plugins.precision.registry import PRECISION_REGISTRY, parse_precision
    from fabric.strategies.ddp import DDPStrategy
    from fabric.strategies.single_device import SingleDeviceStrategy

    name = parse_precision("16-mixed" if precision == "amp" else precision)
    strategy = fabric.strategy
    current = strategy.precision.name
    if name == current:
        return None
    if name not in SWITCHABLE_PRECISIONS or current not in SWITCHABLE_PRECISIONS:
        raise ValueError(
            f"fit(precision={precision!r}) cannot switch from {current!r}: only {list(SWITCHABLE_PRECISIONS)} "
            "(float32 parameters, autocast) switch between fits; a '*-true' precision converts the model's parameters."
        )
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise ValueError(
            f"fit(precision={precision!r}) cannot switch the precision under {type(strategy).__name__}: it was built "
            "into the model's set-up (FSDP's parameter casting, DeepSpeed's engine). Set it in the Trainer."
        )
    if name.startswith("bf16") and not fabric.accelerator.supports_dtype(torch.bfloat16):
        raise ValueError(f"fit(precision={precision!r}) needs bfloat16, which this device does not support.")
    plugin: Precision = PRECISION_REGISTRY.create(name, device_type=fabric.accelerator.device_type)
    return plugin


def switch_precision(fabric: Fabric, plugin: Precision) -> None:
    """Make ``plugin`` the strategy's precision: set-up modules and optimizers consult it at every call."""
    fabric.strategy.precision = plugin


def restarted_interval(interval: IntervalFunction) -> IntervalFunction:
    """A fresh interval like ``interval`` (a Time interval from :func:`create_interval` remembers where it last fired,
    which a clock reset makes wrong); a user's own callable is returned as it is."""
    unit, every = getattr(interval, "unit", None), getattr(interval, "every", None)
    end = bool(getattr(interval, "include_end_of_training", True))
    if isinstance(unit, TimeUnit) and isinstance(every, int):
        return create_interval(Time(every, unit), include_end_of_training=end)
    fraction, name = getattr(interval, "fraction", None), getattr(interval, "name", "interval")
    if isinstance(fraction, float) and callable(getattr(interval, "check", None)):
        return create_interval(Time(fraction, TimeUnit.DURATION), name=str(name), include_end_of_training=end)
    return interval
