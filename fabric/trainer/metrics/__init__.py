"""The Trainer's metrics: how it feeds and computes them (:mod:`fabric.trainer.metrics.rounds`), and Composer's
metric classes under Composer's names (``from composer.metrics import CrossEntropy`` becomes ``from
fabric.trainer.metrics import CrossEntropy``), which need torchmetrics and load on first use.

``MAP`` (COCO mean average precision) is not provided: it needs pycocotools and torchvision's box operations;
torchmetrics' ``MeanAveragePrecision`` is the alternative.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from fabric.trainer.metrics.rounds import CallableMetric, compute_metrics, model_metrics, update_metric
from fabric.utilities.lazy import install_hint

#: Composer's metric classes and the module of this package that holds each.
COMPOSER_METRICS = {
    "CrossEntropy": "fabric.trainer.metrics.general",
    "LossMetric": "fabric.trainer.metrics.general",
    "MIoU": "fabric.trainer.metrics.general",
    "Dice": "fabric.trainer.metrics.general",
    "BinaryF1Score": "fabric.trainer.metrics.nlp",
    "LanguageCrossEntropy": "fabric.trainer.metrics.nlp",
    "LanguagePerplexity": "fabric.trainer.metrics.nlp",
    "MaskedAccuracy": "fabric.trainer.metrics.nlp",
}

__all__ = ["CallableMetric", "compute_metrics", "model_metrics", "update_metric", *COMPOSER_METRICS]


def __getattr__(name: str) -> Any:
    if name == "MAP":
        raise ImportError(
            "Composer's MAP is not provided here (it needs pycocotools and torchvision's box operations); use "
            "torchmetrics.detection.MeanAveragePrecision."
        )
    if name not in COMPOSER_METRICS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(COMPOSER_METRICS[name])
    except ModuleNotFoundError as error:
        if error.name != "torchmetrics":
            raise
        raise ModuleNotFoundError(
            f"fabric.trainer.metrics.{name} is a torchmetrics Metric: {install_hint('torchmetrics', 'torchmetrics')}.",
            name="torchmetrics",
        ) from error
    value = getattr(module, name)
    setattr(sys.modules[__name__], name, value)
    return value
