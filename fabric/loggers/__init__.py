"""Experiment loggers: persist metrics and hyperparameters from global rank 0.

``TensorBoardLogger`` imports ``tensorboard`` only when it first writes, so importing this package never
needs the optional extra.
"""

from fabric.loggers.csv_logs import CSVLogger
from fabric.loggers.logger import Logger
from fabric.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
