"""Composer's general metrics (``composer.metrics``): cross-entropy, any loss as a metric, and the segmentation
scores, as torchmetrics ``Metric`` s that sum their counts over ranks when computed.

Each is this project's own implementation of what Composer documents for it; the differences are stated in the
class docstrings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from typing_extensions import override


class CrossEntropy(Metric):
    """Cross-entropy of logits ``(N, C, ...)`` against class indices (``ignore_index`` left out) or class
    probabilities of the logits' shape, averaged over the targets counted in every batch since ``reset``.

    Composer averages the per-batch means; this is the mean over all targets, which equals it for batches of one size.
    """

    full_state_update = False
    sum_loss: torch.Tensor
    total: torch.Tensor

    def __init__(self, dist_sync_on_step: bool = False, ignore_index: int = -100) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.ignore_index = ignore_index
        self.add_state("sum_loss", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds = preds.float()
        if target.shape == preds.shape:  # class probabilities: every sample counts
            losses = F.cross_entropy(preds, target.float(), reduction="sum")
            counted = target.numel() // target.shape[1]
        else:
            losses = F.cross_entropy(preds, target, ignore_index=self.ignore_index, reduction="sum")
            counted = int((target != self.ignore_index).sum())
        self.sum_loss += losses.detach().double()
        self.total += counted

    @override
    def compute(self) -> torch.Tensor:
        return self.sum_loss / self.total


class LossMetric(Metric):
    """The mean over batches of ``loss_function(preds, target)`` (a scalar per batch), e.g. a loss to watch."""

    full_state_update = False
    sum_loss: torch.Tensor
    total_batches: torch.Tensor

    def __init__(self, loss_function: Callable[..., torch.Tensor], dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        if not callable(loss_function):
            raise TypeError(f"LossMetric(loss_function={loss_function!r}) needs a callable (preds, target) -> loss.")
        self.loss_function = loss_function
        self.add_state("sum_loss", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_batches", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, preds: Any, target: Any) -> None:
        loss = torch.as_tensor(self.loss_function(preds, target)).detach()
        if loss.numel() != 1:
            raise ValueError(f"LossMetric: the loss function gave {loss.numel()} values; it must reduce to one.")
        self.sum_loss += loss.double().reshape(())
        self.total_batches += 1

    @override
    def compute(self) -> torch.Tensor:
        return self.sum_loss / self.total_batches


class _ConfusionCounts(Metric):
    """Per-class true-positive, false-positive and false-negative counts of ``argmax(logits, 1)`` against class
    indices, pixels labelled ``ignore_index`` left out."""

    full_state_update = False
    true_positives: torch.Tensor
    false_positives: torch.Tensor
    false_negatives: torch.Tensor

    def __init__(self, num_classes: int, ignore_index: int = -1, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(
                f"num_classes={num_classes!r} is not valid. Accepted: a whole number of classes, 1 or more."
            )
        self.num_classes, self.ignore_index = num_classes, ignore_index
        for name in ("true_positives", "false_positives", "false_negatives"):
            self.add_state(name, default=torch.zeros(num_classes, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        predictions = logits.argmax(dim=1)
        kept = targets != self.ignore_index
        predictions, targets = predictions[kept], targets[kept]
        classes = self.num_classes
        hits = torch.bincount(targets[predictions == targets], minlength=classes)[:classes]
        predicted = torch.bincount(predictions, minlength=classes)[:classes]
        actual = torch.bincount(targets, minlength=classes)[:classes]
        self.true_positives += hits.double()
        self.false_positives += (predicted - hits).double()
        self.false_negatives += (actual - hits).double()

    def _mean_over_present(self, scores: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        return scores[present].mean() if bool(present.any()) else torch.tensor(float("nan"), dtype=torch.float64)


class MIoU(_ConfusionCounts):
    """Mean intersection over union of a segmentation: per class, over every pixel since ``reset``, then averaged
    over the classes that appear in the predictions or the targets. Pixels labelled ``ignore_index`` do not count."""

    @override
    def compute(self) -> torch.Tensor:
        union = self.true_positives + self.false_positives + self.false_negatives
        return self._mean_over_present(self.true_positives / union.clamp(min=1), union > 0)


class Dice(_ConfusionCounts):
    """The Dice coefficient of a segmentation, ``2 TP / (2 TP + FP + FN)`` per class over every pixel since
    ``reset``, averaged over the classes that appear in the predictions or the targets."""

    @override
    def compute(self) -> torch.Tensor:
        denominator = 2 * self.true_positives + self.false_positives + self.false_negatives
        return self._mean_over_present(2 * self.true_positives / denominator.clamp(min=1), denominator > 0)
