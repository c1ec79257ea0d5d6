"""Label smoothing: train towards ``(1 - smoothing) * one_hot + smoothing / num_classes`` instead of one-hot labels.

Keeps the model from becoming over-confident. From "Rethinking the Inception Architecture for Computer
Vision" (Szegedy et al., CVPR 2016).

Events: the targets are smoothed at ``BEFORE_LOSS`` (the number of classes is the outputs' dimension 1; soft
targets, e.g. from MixUp, are smoothed as they are) and the original targets are put back at
``AFTER_LOSS``, so metrics see the real labels. The loss must accept class probabilities
(``F.cross_entropy`` does). Because closing events run algorithms in reverse order, this nests correctly with
MixUp or CutMix in either order: smoothing and mixing are both convex combinations, so they commute.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from fabric.trainer.algorithms.batch import BatchKey, check_batch_key, get_batch_item, set_batch_item
from fabric.trainer.algorithms.mixup import to_probabilities
from fabric.trainer.core.algorithm import Algorithm
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State


def _check_smoothing(smoothing: float) -> float:
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float) or not 0 <= smoothing < 1:
        raise ValueError(f"LabelSmoothing: smoothing={smoothing!r} must be in [0, 1).")
    return float(smoothing)


def smooth_labels(logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    """Smoothed probability targets for ``logits`` (classes along dim 1) from class indices or probabilities."""
    num_classes = int(logits.shape[1])
    probabilities = to_probabilities(targets, logits)
    smoothing = _check_smoothing(smoothing)
    return (1.0 - smoothing) * probabilities + smoothing / num_classes


class LabelSmoothing(Algorithm):
    """Label smoothing (see the module docstring)."""

    def __init__(self, smoothing: float = 0.1, target_key: BatchKey = 1) -> None:
        self.smoothing = _check_smoothing(smoothing)
        self.target_key = check_batch_key("target_key", target_key)
        self._original_targets: Any = None

    @override
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.BEFORE_LOSS, Event.AFTER_LOSS)

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event is Event.BEFORE_LOSS:
            self._original_targets = get_batch_item(state.batch, self.target_key)
            smoothed = smooth_labels(state.outputs, self._original_targets, self.smoothing)
            state.batch = set_batch_item(state.batch, self.target_key, smoothed)
        elif self._original_targets is not None:
            state.batch = set_batch_item(state.batch, self.target_key, self._original_targets)
            self._original_targets = None

    def __repr__(self) -> str:
        return f"LabelSmoothing(smoothing={self.smoothing})"
