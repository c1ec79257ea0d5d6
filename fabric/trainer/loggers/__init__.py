"""The trainer's loggers: a :class:`Logger` facade and the destinations it writes to."""

from __future__ import annotations

from fabric.trainer.loggers.destination import LoggerDestination
from fabric.trainer.loggers.logger import Logger

__all__ = ["Logger", "LoggerDestination"]
