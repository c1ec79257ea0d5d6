"""``ConsoleLogger``: one readable line of the latest values every ``log_interval``, and one per evaluation."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from typing_extensions import override

from fabric.trainer.core.events import Event
from fabric.trainer.intervals import IntervalInput, create_interval
from fabric.trainer.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class ConsoleLogger(LoggerDestination):
    """Prints ``[epoch=1 batch=40] train: loss/train/total: 0.2153, lr-SGD/group0: 0.1``.

    Training values are collected as they are logged and the latest of each is printed every
    ``log_interval`` (``"1ep"``, ``"50ba"``, any interval the Trainer's ``eval_interval`` accepts,
    an int meaning epochs), plus at the end of ``fit`` for whatever was logged since the last line.
    Values logged during an evaluation are printed on their own line, labelled with the evaluator,
    when it ends.

    Args:
        log_interval: How often to print the training values.
        stream: Where to print; ``None`` means ``sys.stdout`` at the time of printing.
    """

    def __init__(self, log_interval: IntervalInput = "1ep", stream: TextIO | None = None) -> None:
        self.log_interval = create_interval(log_interval, name="log_interval")
        self.stream = stream
        self._train_values: dict[str, float] = {}
        self._eval_values: dict[str, float] = {}
        self._evaluating = False

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        (self._eval_values if self._evaluating else self._train_values).update(metrics)

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        if self.log_interval(state, Event.BATCH_END):
            self._print_line(state, "train", self._train_values)

    @override
    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.log_interval(state, Event.EPOCH_END):
            self._print_line(state, "train", self._train_values)

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        self._print_line(state, "train", self._train_values)

    @override
    def eval_start(self, state: State, logger: Logger) -> None:
        self._evaluating = True

    @override
    def eval_end(self, state: State, logger: Logger) -> None:
        self._evaluating = False
        self._print_line(state, state.dataloader_label or "eval", self._eval_values)

    def _print_line(self, state: State, label: str, values: dict[str, float]) -> None:
        """Print ``values`` (if any) on one line and forget them, so each value is printed once."""
        if not values:
            return
        listed = ", ".join(f"{name}: {value:.6g}" for name, value in values.items())
        stamp = f"[epoch={int(state.timestamp.epoch)} batch={int(state.timestamp.batch)}]"
        print(f"{stamp} {label}: {listed}", file=self.stream or sys.stdout, flush=True)
        values.clear()
