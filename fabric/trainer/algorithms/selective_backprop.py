"""Selective backprop: train only on the samples the model currently gets most wrong.

Between ``start`` and ``end`` (fractions of training), a cheap no-grad forward scores every sample of the
batch by its loss, and only the ``round(keep * n)`` highest-loss samples (at least one) go through the real
forward and backward. As in Composer, every ``interrupt``-th batch of the epoch trains in full
(``batch_in_epoch + 1`` a multiple of ``interrupt``), so the default ``interrupt=2`` alternates selective and full
batches; ``interrupt=0`` never interrupts.
``scale_factor < 1`` scores images downscaled by that factor, making the scoring pass cheaper. From
"Accelerating Deep Learning by Focusing on the Biggest Losers" (Jiang et al., 2019).

Event: ``AFTER_DATALOADER``. The scoring forward runs with the model in eval mode (no dropout noise, no
BatchNorm statistics updated by the extra pass) and restores the mode afterwards. Per-sample losses come from
``loss_fn(outputs, targets, reduction="none")`` if given, else from the model's
``loss(outputs, batch, reduction="none")``, which must then accept ``reduction``; losses with more than one
value per sample (per token, per pixel) are averaged per sample.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from fabric.trainer.algorithms.batch import BatchKey, check_batch_key, get_batch_item, index_batch, set_batch_item
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.microbatch import batch_size

LossFunction = Callable[..., torch.Tensor]


def should_select(elapsed: float, batch_in_epoch: int, start: float, end: float, interrupt: int) -> bool:
    """Whether batch ``batch_in_epoch`` (0-based, within the epoch) at ``elapsed`` (fraction of training) is
    trained selectively: inside ``[start, end)`` and not an interrupting full batch (as Composer decides it)."""
    in_window = start <= elapsed < end
    return in_window and (interrupt == 0 or (batch_in_epoch + 1) % interrupt != 0)


def _accepts_reduction(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "reduction" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def per_sample_losses(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFunction | None = None,
    scale_factor: float = 1.0,
    input_key: BatchKey = 0,
    target_key: BatchKey = 1,
) -> torch.Tensor:
    """One loss per sample of ``batch`` from a no-grad, eval-mode forward (see the module docstring)."""
    scored = batch
    if scale_factor < 1:
        inputs = get_batch_item(batch, input_key)
        small = F.interpolate(inputs, scale_factor=scale_factor, mode="bilinear", recompute_scale_factor=False)
        scored = set_batch_item(batch, input_key, small)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(scored)
            if loss_fn is not None:
                losses = loss_fn(outputs, get_batch_item(batch, target_key), reduction="none")
            else:
                loss: Any = model.loss
                losses = loss(outputs, scored, reduction="none")
    finally:
        model.train(was_training)
    return losses.reshape(losses.shape[0], -1).float().mean(dim=1)


def select_using_loss(batch: Any, losses: torch.Tensor, keep: float) -> Any:
    """The ``max(1, round(keep * n))`` samples of ``batch`` with the highest ``losses``, in their original order."""
    count = max(1, round(keep * losses.shape[0]))
    chosen = losses.topk(count).indices.sort().values
    return index_batch(batch, chosen)


class SelectiveBackprop(Algorithm):
    """Selective backprop (see the module docstring)."""

    def __init__(
        self,
        start: float = 0.5,
        end: float = 0.9,
        keep: float = 0.5,
        scale_factor: float = 1.0,
        interrupt: int = 2,
        loss_fn: LossFunction | None = None,
        input_key: BatchKey = 0,
        target_key: BatchKey = 1,
    ) -> None:
        for name, fraction in (("start", start), ("end", end)):
            if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction <= 1:
                raise ValueError(f"SelectiveBackprop: {name}={fraction!r} must be a fraction of training in [0, 1].")
        if start >= end:
            raise ValueError(f"SelectiveBackprop: start={start!r} must be less than end={end!r}.")
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
            raise ValueError(f"SelectiveBackprop: keep={keep!r} must be in (0, 1].")
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, int | float) or not 0 < scale_factor <= 1:
            raise ValueError(f"SelectiveBackprop: scale_factor={scale_factor!r} must be in (0, 1].")
        if isinstance(interrupt, bool) or not isinstance(interrupt, int) or interrupt < 0:
            raise ValueError(f"SelectiveBackprop: interrupt={interrupt!r} must be a non-negative int.")
        if loss_fn is not None and not _accepts_reduction(loss_fn):
            raise ValueError("SelectiveBackprop: loss_fn must accept reduction='none' to give per-sample losses.")
        self.start, self.end, self.keep, self.scale_factor = start, end, keep, scale_factor
        self.interrupt, self.loss_fn = interrupt, loss_fn
        self.input_key = check_batch_key("input_key", input_key)
        self.target_key = check_batch_key("target_key", target_key)
        self._loss_checked = loss_fn is not None

    @override
    def match(self, event: Event, state: State) -> bool:
        if event is Event.INIT:
            return not self._loss_checked
        if event is not Event.AFTER_DATALOADER:
            return False
        return should_select(
            float(state.get_elapsed_duration()),
            int(state.timestamp.batch_in_epoch),
            self.start,
            self.end,
            self.interrupt,
        )

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if not self._loss_checked:
            self._check_model_loss(state.model)
            self._loss_checked = True
        if event is Event.AFTER_DATALOADER:
            losses = per_sample_losses(
                state.model, state.batch, self.loss_fn, self.scale_factor, self.input_key, self.target_key
            )
            state.batch = select_using_loss(state.batch, losses, self.keep)
            if logger is not None:
                logger.log_metrics({"selective_backprop/kept_samples": batch_size(state.batch)})

    @staticmethod
    def _check_model_loss(model: nn.Module) -> None:
        loss = getattr(model, "loss", None)
        if loss is None or not _accepts_reduction(loss):
            raise ValueError(
                f"SelectiveBackprop needs per-sample losses: give loss_fn=..., or let {type(model).__name__}.loss "
                "accept reduction='none'."
            )

    def __repr__(self) -> str:
        return f"SelectiveBackprop(start={self.start}, end={self.end}, keep={self.keep})"
