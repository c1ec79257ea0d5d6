"""Metrics the Trainer updates per batch and computes per round, synced across ranks.

A metric is either an object with ``update``/``compute``/``reset`` (torchmetrics ``Metric``, which
syncs itself across processes in ``compute``) or a plain callable ``(outputs, batch) -> number``,
which :class:`CallableMetric` averages over samples and all-reduces through Fabric at ``compute``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from fabric.trainer.model import TrainerModel

if TYPE_CHECKING:
    from fabric.fabric import Fabric

MetricFunction = Callable[[Any, Any], "float | torch.Tensor"]


class CallableMetric:
    """The sample-weighted mean of ``function(outputs, batch)`` over every batch since :meth:`reset`."""

    def __init__(self, function: MetricFunction, fabric: Fabric | None = None) -> None:
        self.function, self.fabric = function, fabric
        self._total = torch.zeros((), dtype=torch.float64)
        self._samples = 0

    def update(self, outputs: Any, batch: Any, samples: int) -> None:
        """Add ``function(outputs, batch)`` weighted by ``samples``, the batch's size as its DataSpec counts it."""
        value = self.function(outputs, batch)
        self._total = self._total + torch.as_tensor(value, dtype=torch.float64).detach().cpu() * samples
        self._samples += samples

    def compute(self) -> torch.Tensor:
        """The mean over every rank, a 0-d float32 tensor as a torchmetrics metric gives (Composer programs call
        ``.compute().item()``); NaN before any update."""
        totals = torch.tensor([float(self._total), float(self._samples)], dtype=torch.float64)
        if self.fabric is not None and self.fabric.world_size > 1:
            totals = self.fabric.all_reduce(totals.to(self.fabric.device), reduce_op="sum").cpu()
        total, samples = totals.tolist()
        return torch.tensor(total / samples if samples else float("nan"))

    def reset(self) -> None:
        self._total = torch.zeros((), dtype=torch.float64)
        self._samples = 0

    def __repr__(self) -> str:
        return f"CallableMetric({getattr(self.function, '__name__', self.function)!r})"


def model_metrics(model: object, is_train: bool, fabric: Fabric) -> dict[str, Any]:
    """Copies of the model's metrics as objects with update/compute/reset, on Fabric's device.

    Each call gives new copies (as Composer deep-copies them): training and every evaluator keep their own state,
    even when the model returns one dict for both, so each reads back its own values after ``fit()``.
    """
    get_metrics = getattr(model, "get_metrics", None)
    if get_metrics is None:
        return {}
    metrics: Mapping[str, Any] = get_metrics(is_train=is_train)
    prepared = {}
    for name, metric in metrics.items():
        if all(hasattr(metric, method) for method in ("update", "compute", "reset")):
            copied = copy.deepcopy(metric)
            prepared[name] = copied.to(fabric.device) if isinstance(copied, torch.nn.Module) else copied
        elif callable(metric):
            prepared[name] = CallableMetric(metric, fabric)
        else:
            raise TypeError(
                f"Metric {name!r} of {type(model).__name__} is a {type(metric).__name__}: expected an object with "
                "update/compute/reset (e.g. a torchmetrics Metric) or a callable (outputs, batch) -> number."
            )
    return prepared


def update_metric(model: Any, batch: Any, outputs: Any, metric: Any, samples: int) -> Any:
    """Feed a batch of ``samples`` samples to ``metric``: callables see the whole batch, others go through the
    model's ``update_metric``, whose result is returned (Composer's ``state.metric_outputs``; None for most)."""
    if isinstance(metric, CallableMetric):
        metric.update(outputs, batch, samples)
        return None
    if hasattr(model, "update_metric"):
        return model.update_metric(batch, outputs, metric)
    return TrainerModel.update_metric(model, batch, outputs, metric)


def compute_metrics(metrics: Mapping[str, Any], prefix: str, by_name: dict[str, Any] | None = None) -> dict[str, float]:
    """Every metric's value as a float, keyed ``f"{prefix}/{name}"``; also written into ``by_name`` keyed by the
    name alone when given (Composer's ``state.eval_metric_values`` and ``train_metric_values``).

    The metrics keep their state until the next round resets them (an evaluation as it starts, the training
    metrics as each batch starts), as in Composer: ``trainer.state.eval_metrics`` read after ``fit()`` give the
    last evaluation's values, not an empty metric's NaN.
    """
    values = {}
    for name, metric in metrics.items():
        value = metric.compute()
        values[f"{prefix}/{name}"] = number = float(value.item() if isinstance(value, torch.Tensor) else value)
        if by_name is not None:
            by_name[name] = number
    return values
