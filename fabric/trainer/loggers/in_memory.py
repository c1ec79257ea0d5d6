"""``InMemoryLogger``: keeps every logged value in Python lists, for tests and notebooks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from typing_extensions import override

from fabric.trainer.loggers.destination import LoggerDestination


class InMemoryLogger(LoggerDestination):
    """Records metrics as ``data[name] = [(step, value), ...]`` and the latest value of each name.

    Every rank keeps one (``all_ranks``), so a test can check what each process logged.
    """

    all_ranks: ClassVar[bool] = True

    def __init__(self) -> None:
        self.data: dict[str, list[tuple[int, float]]] = {}
        self.most_recent_values: dict[str, float] = {}
        self.hyperparameters: dict[str, Any] = {}

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.data.setdefault(name, []).append((step, value))
            self.most_recent_values[name] = value

    @override
    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        self.hyperparameters.update(hyperparameters)
