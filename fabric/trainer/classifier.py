"""``TrainerClassifier``: any classifier ``nn.Module`` as a Trainer model (Composer's ``ComposerClassifier``).

Batches are ``(inputs, targets)``. The loss is cross-entropy over class indices or class probabilities (the soft
targets MixUp, CutMix and LabelSmoothing give). Default metrics, by Composer's names: ``MulticlassAccuracy`` in
training and evaluation, and ``CrossEntropy`` in evaluation; both are sample-weighted means over all ranks, so
they need neither torchmetrics nor ``num_classes``. Pass ``train_metrics``/``val_metrics`` (torchmetrics
metrics, a list or a dict of them, or ``(outputs, batch) -> number`` callables) to choose others.

Under Composer's names: :class:`ComposerClassifier` (this class, also a :class:`~fabric.trainer.model.ComposerModel`)
and :class:`ComposerResNet` (a torchvision ResNet as a classifier; needs ``torchvision``, imported only when one is
made).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from fabric.trainer.model import ComposerModel, TrainerModel, batch_targets

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsInput = Any | Sequence[Any] | Mapping[str, Any] | None
Initializer = str | Callable[[nn.Module], None]


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

    @override
    def forward(self, batch: Any) -> Any:
        return self.module(batch_inputs(batch))

    @override
    def loss(self, outputs: Any, batch: Any) -> Any:
        return self.loss_fn(outputs, batch_targets(batch))

    @override
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


class ComposerClassifier(TrainerClassifier, ComposerModel):
    """Composer's name for :class:`TrainerClassifier`, with the same arguments (``module``, ``num_classes``,
    ``train_metrics``, ``val_metrics``, ``loss_fn``); an instance is also a :class:`ComposerModel`."""


def _linear_or_conv_weight(init: Callable[[torch.Tensor], object]) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            init(module.weight)

    return apply


def _batchnorm(weight: Callable[[torch.Tensor], object]) -> Callable[[nn.Module], None]:
    def apply(module: nn.Module) -> None:
        if isinstance(module, nn.BatchNorm2d) and module.weight is not None and module.bias is not None:
            with torch.no_grad():
                weight(module.weight)
                module.bias.zero_()

    return apply


def _log_constant_bias(module: nn.Module) -> None:
    if isinstance(module, nn.Linear) and module.bias is not None:
        with torch.no_grad():
            module.bias.fill_(-math.log(module.bias.shape[0]))


#: Composer's ``Initializer`` names: each a function applied to every submodule (``module.apply``).
INITIALIZERS: dict[str, Callable[[nn.Module], None]] = {
    "kaiming_normal": _linear_or_conv_weight(nn.init.kaiming_normal_),
    "kaiming_uniform": _linear_or_conv_weight(nn.init.kaiming_uniform_),
    "xavier_uniform": _linear_or_conv_weight(nn.init.xavier_uniform_),
    "xavier_normal": _linear_or_conv_weight(nn.init.xavier_normal_),
    "bn_ones": _batchnorm(nn.init.ones_),
    "bn_uniform": _batchnorm(nn.init.uniform_),  # U(0, 1), as Composer's torch.rand
    "linear_log_constant_bias": _log_constant_bias,
}


class ComposerResNet(ComposerClassifier):
    """Composer's ``ComposerResNet``: a torchvision ResNet (``torchvision.models.<model_name>``) as a classifier.

    Needs ``torchvision`` (``pip install torchvision``, matching the installed torch), imported when a model is made,
    so ``import fabric.trainer`` does not load it. Loss and metrics are :class:`TrainerClassifier`'s: cross-entropy
    over class indices or class probabilities (Composer's ``soft_cross_entropy``), ``MulticlassAccuracy`` and
    ``CrossEntropy``.

    Args:
        model_name: one of :attr:`valid_model_names`.
        num_classes: the classifier's outputs (default 1000, ImageNet's).
        pretrained: torchvision's default ImageNet weights (``weights="DEFAULT"``; torchvision downloads them).
        groups, width_per_group: the bottleneck blocks' 3x3 convolution groups and width (ResNeXt-style); torchvision
            refuses other values than 1 and 64 for ``resnet18``/``resnet34``.
        initializers: applied in order to every submodule after the model is made: Composer's names
            (:data:`INITIALIZERS`: ``"kaiming_normal"``, ``"bn_ones"``, ...) or functions ``module -> None``.
        weights: torchvision's ``weights`` (e.g. ``"IMAGENET1K_V2"``), the newer spelling of ``pretrained``.
    """

    valid_model_names = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")

    def __init__(
        self,
        model_name: str,
        num_classes: int = 1000,
        pretrained: bool = False,
        groups: int = 1,
        width_per_group: int = 64,
        initializers: Sequence[Initializer] | None = None,
        weights: str | None = None,
    ) -> None:
        if model_name not in self.valid_model_names:
            raise ValueError(f"model_name={model_name!r} is not valid. Accepted: {', '.join(self.valid_model_names)}.")
        if pretrained and weights is not None:
            raise ValueError(f"pretrained=True and weights={weights!r}: give one of them.")
        functions = [_initializer(initializer) for initializer in initializers or ()]
        try:
            models = importlib.import_module("torchvision.models")
        except ImportError as error:
            raise ImportError(
                "ComposerResNet needs torchvision: pip install torchvision (a build matching the installed torch)."
            ) from error
        module = getattr(models, model_name)(
            weights="DEFAULT" if pretrained else weights,
            num_classes=num_classes,
            groups=groups,
            width_per_group=width_per_group,
        )
        for function in functions:
            module.apply(function)
        super().__init__(module, num_classes=num_classes)


def _initializer(initializer: Initializer) -> Callable[[nn.Module], None]:
    if isinstance(initializer, str):
        if initializer not in INITIALIZERS:
            raise ValueError(
                f"initializer {initializer!r} is not valid. Accepted: {', '.join(INITIALIZERS)}, or a function."
            )
        return INITIALIZERS[initializer]
    if not callable(initializer):
        raise TypeError(
            f"initializer {initializer!r} is neither one of Composer's names nor a function module -> None."
        )
    return initializer
