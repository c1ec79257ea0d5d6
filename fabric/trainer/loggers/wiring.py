"""One set of destinations for a Trainer and its Fabric: what ``Trainer(loggers=...)`` and ``fabric.log`` reach.

:func:`connect_loggers` builds the Trainer's :class:`~fabric.trainer.core.logger.Logger` facade over

- the destinations given to the Trainer (Fabric loggers among them adapted, the progress bar added), and
- the loggers the Fabric already holds (``Fabric(loggers=[...])``), adapted, so the Trainer's values reach them,

and gives the Fabric a :class:`FabricRoute` to the Trainer's own destinations, so ``fabric.log(...)`` and
``fabric.log_dict(...)`` (from a callback, an algorithm, ``ThroughputMonitor``) reach them at the current
batch. Each destination receives each value once: the Fabric writes its own loggers directly.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from typing_extensions import override

from fabric.loggers.logger import Logger as FabricLogger
from fabric.loggers.logger import params_to_dict
from fabric.trainer.core.logger import Logger
from fabric.trainer.loggers.destination import LoggerDestination
from fabric.trainer.loggers.fabric_logger import FabricLoggerDestination

if TYPE_CHECKING:
    from fabric.fabric import Fabric
    from fabric.trainer.core.state import State

#: What ``Trainer(loggers=...)`` accepts: trainer destinations and Fabric's loggers.
LoggerInput: TypeAlias = LoggerDestination | FabricLogger


class FabricRoute(FabricLogger):
    """A :class:`fabric.loggers.Logger` that hands what Fabric logs to a trainer's :class:`Logger` facade.

    A metric logged without a step gets the batch count, as the Trainer's own values do.
    """

    def __init__(self, facade: Logger) -> None:
        self.facade = facade

    @property
    @override
    def name(self) -> str | None:
        return self.facade.state.run_name

    @property
    @override
    def version(self) -> None:
        return None

    @override
    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        self.facade.log_metrics(metrics, step)

    @override
    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        self.facade.log_hyperparameters(params_to_dict(params))


def connect_loggers(
    state: State, fabric: Fabric, loggers: Sequence[Any], progress_bar: bool
) -> Logger[LoggerDestination]:
    """The Trainer's facade over ``loggers`` and ``fabric``'s own loggers; ``fabric.log`` reaches the first ones."""
    held = [logger for logger in fabric.loggers if not isinstance(logger, FabricRoute)]  # an earlier Trainer's route
    own = as_destinations(loggers, progress_bar, fabric.global_rank)
    adopted = as_destinations(held, False, fabric.global_rank)
    fabric.loggers = [*held, FabricRoute(Logger(state, own))] if own else held
    return Logger(state, [*own, *adopted])


def as_destinations(loggers: Sequence[Any], progress_bar: bool, global_rank: int) -> list[LoggerDestination]:
    """Loggers as destinations (Fabric loggers adapted), the progress bar added; other ranks keep all-rank ones."""
    destinations: list[LoggerDestination] = []
    for logger in loggers:
        if isinstance(logger, FabricLogger):
            destinations.append(FabricLoggerDestination(logger))
        elif isinstance(logger, LoggerDestination):
            destinations.append(logger)
        else:
            raise TypeError(
                f"loggers must be LoggerDestination objects (fabric.trainer.loggers) or fabric.loggers Loggers, "
                f"got {type(logger).__name__}."
            )
    if progress_bar:
        from fabric.trainer.loggers.progress_bar import ProgressBarLogger

        if not any(isinstance(destination, ProgressBarLogger) for destination in destinations):
            destinations.append(ProgressBarLogger())
    if global_rank != 0:
        destinations = [destination for destination in destinations if destination.all_ranks]
    return destinations
