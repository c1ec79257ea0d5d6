"""``ProgressBarLogger``: tqdm bars for training (with the latest loss and epoch) and for each evaluation."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

from typing_extensions import override

from fabric.trainer.core.time import TimeUnit
from fabric.trainer.loggers.destination import LoggerDestination

if TYPE_CHECKING:
    from tqdm import tqdm

    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

LOSS_NAME = "loss/train/total"


class ProgressBarLogger(LoggerDestination):
    """The Trainer's default destination on rank 0 (``progress_bar=True``).

    Training gets one bar for the whole run when its length in batches is known (``max_duration`` in
    ``ba``, or in ``ep`` with a dataloader of known length), otherwise one bar per epoch. Its postfix
    shows the epoch and the latest ``loss/train/total``. Each evaluator gets its own bar, labelled
    ``eval <label>`` (just ``eval`` for the default label), which disappears when that evaluation ends.

    Args:
        stream: Where to draw; ``None`` means ``sys.stderr`` at the time a bar is created.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._train_bar: tqdm[Any] | None = None
        self._bar_per_epoch = False
        self._eval_bar: tqdm[Any] | None = None
        self._latest_loss: float | None = None

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if LOSS_NAME in metrics:
            self._latest_loss = metrics[LOSS_NAME]

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        self._close_train_bar()
        total = _batches_in_run(state)
        self._bar_per_epoch = total is None
        if total is not None:
            done = min(int(state.timestamp.batch), total)  # a resumed run starts part-way
            self._train_bar = self._new_bar("train", total, initial=done, leave=True)

    @override
    def epoch_start(self, state: State, logger: Logger) -> None:
        if self._bar_per_epoch:
            self._close_train_bar()
            description = f"train epoch {int(state.timestamp.epoch)}"
            self._train_bar = self._new_bar(description, state.dataloader_len, leave=True)

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        if self._train_bar is None:
            return
        postfix: dict[str, Any] = {"epoch": int(state.timestamp.epoch)}
        if self._latest_loss is not None:
            postfix[LOSS_NAME] = f"{self._latest_loss:.4g}"
        self._train_bar.set_postfix(postfix, refresh=False)  # drawn by update(), at tqdm's refresh rate
        self._train_bar.update(1)

    @override
    def epoch_end(self, state: State, logger: Logger) -> None:
        if self._bar_per_epoch:
            self._close_train_bar()

    @override
    def fit_end(self, state: State, logger: Logger) -> None:
        self._close_train_bar()

    @override
    def eval_start(self, state: State, logger: Logger) -> None:
        self._close_eval_bar()
        label = state.dataloader_label or "eval"
        description = "eval" if label == "eval" else f"eval {label}"
        self._eval_bar = self._new_bar(description, state.eval_batches, leave=False)

    @override
    def eval_batch_end(self, state: State, logger: Logger) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)

    @override
    def eval_end(self, state: State, logger: Logger) -> None:
        self._close_eval_bar()

    @override
    def close(self, state: State | None = None, logger: Logger | None = None) -> None:
        self._close_eval_bar()
        self._close_train_bar()

    def _new_bar(self, description: str, total: int | None, *, leave: bool, initial: int = 0) -> tqdm[Any]:
        from tqdm import tqdm  # tqdm only loads once a bar is drawn

        return tqdm(
            desc=description,
            total=total,
            initial=initial,
            leave=leave,
            unit="ba",
            file=self.stream or sys.stderr,
            dynamic_ncols=True,
        )

    def _close_train_bar(self) -> None:
        if self._train_bar is not None:
            self._train_bar.close()
            self._train_bar = None

    def _close_eval_bar(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None


def _batches_in_run(state: State) -> int | None:
    """The number of batches ``max_duration`` amounts to, when it can be known before training."""
    max_duration = state.max_duration
    if max_duration is None:
        return None
    if max_duration.unit is TimeUnit.BATCH:
        return int(max_duration)
    if max_duration.unit is TimeUnit.EPOCH and state.dataloader_len is not None:
        return int(max_duration) * state.dataloader_len
    return None
