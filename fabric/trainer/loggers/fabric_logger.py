"""Use Fabric's experiment loggers (:mod:`fabric.loggers`: CSV, TensorBoard, your own) as trainer destinations.

:class:`FabricLoggerDestination` adapts any :class:`fabric.loggers.Logger`; the Trainer wraps a plain
Fabric logger given in ``loggers=[...]`` with it. :class:`CSVLogger` and :class:`TensorBoardLogger`
build the Fabric logger from the same arguments, so ``loggers=[CSVLogger("runs")]`` needs one import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fabric.loggers import csv_logs, tensorboard
from fabric.loggers.logger import Logger as FabricLogger
from fabric.trainer.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from fabric.trainer.state import State


class FabricLoggerDestination(LoggerDestination):
    """Forwards metrics and hyperparameters to ``logger``; saves it when ``fit`` ends and finalizes it on close."""

    def __init__(self, logger: FabricLogger) -> None:
        if not isinstance(logger, FabricLogger):
            raise TypeError(f"Expected a fabric.loggers.Logger (CSVLogger, TensorBoardLogger, ...), got {logger!r}.")
        self.logger = logger

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step)

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        self.logger.log_hyperparams(hyperparameters)

    def fit_end(self, state: State, logger: Any) -> None:
        self.logger.save()  # the files are complete once fit() returns, before close()

    def close(self, state: State | None = None, logger: Any = None) -> None:
        self.logger.finalize("success")


class CSVLogger(FabricLoggerDestination):
    """:class:`fabric.loggers.CSVLogger` as a destination: ``<root_dir>/<name>/<version>/metrics.csv``."""

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        name: str = "fabric_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(csv_logs.CSVLogger(root_dir, name, version, prefix, flush_logs_every_n_steps))


class TensorBoardLogger(FabricLoggerDestination):
    """:class:`fabric.loggers.TensorBoardLogger` as a destination; ``tensorboard`` is imported on the first write."""

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        name: str = "fabric_logs",
        version: int | str | None = None,
        default_hp_metric: bool = False,
        prefix: str = "",
        **summary_writer_kwargs: Any,
    ) -> None:
        super().__init__(
            tensorboard.TensorBoardLogger(root_dir, name, version, default_hp_metric, prefix, **summary_writer_kwargs)
        )
