"""``Logger``: the object algorithms and callbacks receive as ``logger``; it fans values out to destinations.

``logger.log_metrics({"lr": 0.1})`` stamps the values with the current batch count, turns tensors
into Python numbers once, and hands them to every destination. With no destination (the default for
benchmarks and most ranks) it returns before converting anything, so logging costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fabric.trainer.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from fabric.trainer.state import State


class Logger:
    def __init__(self, state: State, destinations: Sequence[LoggerDestination] = ()) -> None:
        self.state = state
        self.destinations: tuple[LoggerDestination, ...] = tuple(destinations)

    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        """Send scalar ``metrics`` to every destination, at ``step`` (default: batches trained so far)."""
        if not self.destinations:
            return
        values = {name: _to_number(name, value) for name, value in metrics.items()}
        at = int(self.state.timestamp.batch) if step is None else step
        for destination in self.destinations:
            destination.log_metrics(values, at)

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        for destination in self.destinations:
            destination.log_hyperparameters(hyperparameters)


def _to_number(name: str, value: float | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Metric {name!r} must be a single number, got a tensor of shape {tuple(value.shape)}.")
        return float(value.item())
    return float(value)
