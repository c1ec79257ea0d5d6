"""Composer's language-model metrics (``composer.metrics.nlp``) as torchmetrics ``Metric`` s: token-level
cross-entropy, perplexity and accuracy over the targets that are not ``ignore_index``, and binary F1.

Outputs may be a logits tensor ``(..., vocabulary)`` or a mapping with ``"logits"`` (a Hugging Face model's
output); targets are token ids of the logits' leading shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from typing_extensions import override


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, Mapping):
        if "logits" not in output:
            raise KeyError(f"A language metric takes logits or a mapping with 'logits'; got keys {sorted(output)}.")
        output = output["logits"]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"A language metric takes logits or a mapping with 'logits'; got {type(output).__name__}.")
    return output


class LanguageCrossEntropy(Metric):
    """Cross-entropy per target token, summed over every batch since ``reset`` and divided by the number of target
    tokens that are not ``ignore_index``."""

    full_state_update = False
    sum_loss: torch.Tensor
    total_items: torch.Tensor

    def __init__(self, dist_sync_on_step: bool = False, ignore_index: int = -100) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.ignore_index = ignore_index
        self.add_state("sum_loss", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_items", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, output: Any, target: torch.Tensor) -> None:
        logits = _logits(output)
        flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1)
        loss = F.cross_entropy(flat_logits, flat_target, ignore_index=self.ignore_index, reduction="sum")
        self.sum_loss += loss.detach().double()
        self.total_items += (flat_target != self.ignore_index).sum().double()

    @override
    def compute(self) -> torch.Tensor:
        return self.sum_loss / self.total_items


class LanguagePerplexity(LanguageCrossEntropy):
    """``exp`` of :class:`LanguageCrossEntropy`."""

    @override
    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


class MaskedAccuracy(Metric):
    """The fraction of target tokens (those that are not ``ignore_index``) whose highest logit is the target."""

    full_state_update = False
    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self, ignore_index: int = -100, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.ignore_index = ignore_index
        self.add_state("correct", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, preds: Any, target: torch.Tensor) -> None:
        predictions = _logits(preds).argmax(dim=-1)
        counted = target != self.ignore_index
        self.correct += ((predictions == target) & counted).sum().double()
        self.total += counted.sum().double()

    @override
    def compute(self) -> torch.Tensor:
        return self.correct / self.total


class BinaryF1Score(Metric):
    """F1 of the positive class, ``TP / (TP + (FP + FN) / 2)``, with predictions ``argmax(logits, 1)`` of
    two-class logits ``(N, 2)`` against targets 0 or 1, over every batch since ``reset``."""

    full_state_update = False
    true_positive: torch.Tensor
    false_positive: torch.Tensor
    false_negative: torch.Tensor

    def __init__(self, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        for name in ("true_positive", "false_positive", "false_negative"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, output: Any, target: torch.Tensor) -> None:
        predictions = _logits(output).argmax(dim=1)
        self.true_positive += ((predictions == 1) & (target == 1)).sum().double()
        self.false_positive += ((predictions == 1) & (target == 0)).sum().double()
        self.false_negative += ((predictions == 0) & (target == 1)).sum().double()

    @override
    def compute(self) -> torch.Tensor:
        return self.true_positive / (self.true_positive + 0.5 * (self.false_positive + self.false_negative))
