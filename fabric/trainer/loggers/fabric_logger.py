"""Fabric's experiment loggers (:mod:`fabric.loggers`: CSV, TensorBoard, your own) as the trainer's destinations.

There is one set of logger classes: :mod:`fabric.loggers` defines ``CSVLogger`` and ``TensorBoardLogger``
once, and the Trainer adapts them instead of defining its own. :class:`FabricLoggerDestination` wraps
any :class:`fabric.loggers.Logger`; the Trainer wraps a plain Fabric logger given in ``loggers=[...]``
(or held by the Fabric it was given) with it. ``fabric.trainer.loggers.CSVLogger`` and
``TensorBoardLogger`` remain, for compatibility, as that adapter applied to Fabric's class: they take
the Fabric class's arguments (one signature, Fabric's) and return a :class:`FabricLoggerDestination`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec

from typing_extensions import override

from fabric.loggers import csv_logs, tensorboard
from fabric.loggers.logger import Logger as FabricLogger
from fabric.trainer.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

_P = ParamSpec("_P")


class FabricLoggerDestination(LoggerDestination):
    """Forwards metrics and hyperparameters to ``logger``; saves it when ``fit`` ends and finalizes it on close."""

    def __init__(self, logger: FabricLogger) -> None:
        if not isinstance(logger, FabricLogger):
            raise TypeError(f"Expected a fabric.loggers.Logger (CSVLogger, TensorBoardLogger, ...), got {logger!r}.")
        self.logger = logger

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step)

    @override
    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        self.logger.log_hyperparams(hyperparameters)

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        self.logger.save()  # the files are complete once fit() returns, before close()

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        self.logger.finalize("success")


def _adapted(logger_class: Callable[_P, FabricLogger]) -> Callable[_P, FabricLoggerDestination]:
    """``logger_class``'s constructor, returning the new logger wrapped as a destination."""

    def build(*args: _P.args, **kwargs: _P.kwargs) -> FabricLoggerDestination:
        return FabricLoggerDestination(logger_class(*args, **kwargs))

    build.__name__ = build.__qualname__ = getattr(logger_class, "__name__", "logger")
    # help() and IDEs show the Fabric class's arguments.
    build.__signature__ = inspect.signature(logger_class).replace(  # type: ignore[attr-defined]
        return_annotation=FabricLoggerDestination
    )
    build.__doc__ = f":class:`fabric.loggers.{build.__name__}` as a trainer destination (a FabricLoggerDestination)."
    return build


#: ``<root_dir>/<name>/<version>/metrics.csv`` through :class:`fabric.loggers.CSVLogger`.
CSVLogger = _adapted(csv_logs.CSVLogger)
#: TensorBoard event files through :class:`fabric.loggers.TensorBoardLogger` (``tensorboard`` loads on first write).
TensorBoardLogger = _adapted(tensorboard.TensorBoardLogger)
