"""The trainer's loggers: a :class:`Logger` facade and the destinations it writes to.

Names load on first use, so ``import fabric.trainer.loggers`` imports none of tqdm, tensorboard, mlflow or wandb.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.loggers.console import ConsoleLogger
    from fabric.trainer.loggers.destination import LoggerDestination
    from fabric.trainer.loggers.fabric_logger import CSVLogger, FabricLoggerDestination, TensorBoardLogger
    from fabric.trainer.loggers.file import FileLogger
    from fabric.trainer.loggers.in_memory import InMemoryLogger
    from fabric.trainer.loggers.mlflow_logger import MLFlowLogger
    from fabric.trainer.loggers.progress_bar import ProgressBarLogger
    from fabric.trainer.loggers.wandb_logger import WandBLogger

__all__ = [
    "CSVLogger",
    "ConsoleLogger",
    "FabricLoggerDestination",
    "FileLogger",
    "InMemoryLogger",
    "Logger",
    "LoggerDestination",
    "MLFlowLogger",
    "ProgressBarLogger",
    "TensorBoardLogger",
    "WandBLogger",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "CSVLogger": "fabric.trainer.loggers.fabric_logger",
        "ConsoleLogger": "fabric.trainer.loggers.console",
        "FabricLoggerDestination": "fabric.trainer.loggers.fabric_logger",
        "FileLogger": "fabric.trainer.loggers.file",
        "InMemoryLogger": "fabric.trainer.loggers.in_memory",
        "Logger": "fabric.trainer.core.logger",
        "LoggerDestination": "fabric.trainer.loggers.destination",
        "MLFlowLogger": "fabric.trainer.loggers.mlflow_logger",
        "ProgressBarLogger": "fabric.trainer.loggers.progress_bar",
        "TensorBoardLogger": "fabric.trainer.loggers.fabric_logger",
        "WandBLogger": "fabric.trainer.loggers.wandb_logger",
    },
)
