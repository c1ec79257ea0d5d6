"""``TrainerClassifier``: any classifier ``nn.Module`` as a Trainer model (Composer's ``ComposerClassifier``).

Batches are ``(inputs, targets)``. The loss is cross-entropy over class indices or class probabilities (the soft
targets MixUp, CutMix and LabelSmoothing give). Default metrics, by Composer's names: ``MulticlassAccuracy`` in
training and evaluation, and ``CrossEntropy`` in evaluation; both are sample-weighted means over all ranks, so
they need neither torchmetrics nor ``num_classes``. Pass ``train_metrics``/``val_metrics`` (torchmetrics
metrics, a list or a dict of them, or ``(outputs, batch) -> number`` callables) to choose others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fabric.trainer.model import TrainerModel, batch_targets

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsInput = Any | Sequence[Any] | Mapping[str, Any] | None


class TrainerClassifier(TrainerModel):
    """Wraps ``module`` (inputs -> logits of shape ``(batch, classes, ...)``) with a loss and metrics.

    Args:
        module: the classifier.
        num_classes: kept as ``self.num_classes`` for algorithms and metrics that ask (default: the module's own
            ``num_classes`` attribute, if any).
        train_metrics, val_metrics: the metrics to compute in training and evaluation (see the module docstring).
        loss_fn: ``(outputs, targets) -> loss``; default ``torch.nn.functional.cross_entropy``, which takes class
            indices and class probabilities alike.
    """

    def __init__(
        self,
        module: nn.Module,
        num_classes: int | None = None,
        train_metrics: MetricsInput = None,
        val_metrics: MetricsInput = None,
        loss_fn: LossFunction = F.cross_entropy,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"TrainerClassifier(module=...) needs an nn.Module, got {type(module).__name__}.")
        if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)):
            raise ValueError(f"num_classes={num_classes!r} is not valid. Accepted: a whole number of classes, or None.")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass a function (outputs, targets) -> loss.")
        self.module = module
        self.num_classes = num_classes if num_classes is not None else getattr(module, "num_classes", None)
        self.loss_fn = loss_fn
        # Plain dicts, not submodules: metrics are no part of the model's state dict or of its sharding.
        self._train_metrics = _as_metrics("train_metrics", train_metrics, {"MulticlassAccuracy": accuracy})
        self._val_metrics = _as_metrics(
            "val_metrics", val_metrics, {"MulticlassAccuracy": accuracy, "CrossEntropy": self._cross_entropy}
        )

    def forward(self, batch: Any) -> Any:
        return self.module(batch_inputs(batch))

    def loss(self, outputs: Any, batch: Any) -> Any:
        return self.loss_fn(outputs, batch_targets(batch))

    def get_metrics(self, is_train: bool = False) -> Mapping[str, Any]:
        return self._train_metrics if is_train else self._val_metrics

    def _cross_entropy(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), batch_targets(batch))


def batch_inputs(batch: Any) -> Any:
    """The inputs of an ``(inputs, targets)`` batch, or ``batch["inputs"]``/``["input"]``/``["x"]`` of a mapping."""
    if isinstance(batch, Mapping):
        for key in ("inputs", "input", "x"):
            if key in batch:
                return batch[key]
        raise KeyError(f"No inputs in a batch with keys {sorted(batch)}; expected 'inputs', 'input' or 'x'.")
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return batch[0]
    raise TypeError(f"TrainerClassifier takes (inputs, targets) batches, got a {type(batch).__name__}.")


def accuracy(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
    """The fraction of samples whose highest logit is the target class (the most probable one for soft targets)."""
    targets: torch.Tensor = batch_targets(batch)
    if targets.shape == outputs.shape:  # class probabilities
        targets = targets.argmax(dim=1)
    return (outputs.argmax(dim=1) == targets).float().mean()


def _as_metrics(name: str, metrics: MetricsInput, default: dict[str, Any]) -> dict[str, Any]:
    """Metrics by name: a dict as given, one metric or a list of them named by their class (Composer's names)."""
    if metrics is None:
        return default
    if isinstance(metrics, Mapping):
        return dict(metrics)
    items = list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
    named: dict[str, Any] = {}
    for metric in items:
        key = getattr(metric, "__name__", None) or type(metric).__name__
        if key in named:
            raise ValueError(f"{name} holds two metrics named {key!r}; pass a dict to name them apart.")
        named[key] = metric
    return named
