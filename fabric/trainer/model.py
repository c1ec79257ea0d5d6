"""What the Trainer needs from a model, and an optional base class that provides the defaults.

Any ``nn.Module`` with ``forward(batch)`` and ``loss(outputs, batch)`` trains. Evaluation also uses,
when present, ``eval_forward(batch, outputs=None)``, ``get_metrics(is_train)`` and
``update_metric(batch, outputs, metric)``; :class:`TrainerModel` supplies all three, so a subclass
only writes ``forward`` and ``loss``. ``loss`` may return one tensor, a dict with a ``"total"`` entry
(or whose values are summed), or one loss per optimizer (see ``Trainer``).

:class:`ComposerModel` is this base class under Composer's name (``from composer.models import ComposerModel``
becomes ``from fabric.trainer import ComposerModel``), a subclass that also forgives a missing ``super().__init__()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from torch import nn

_Model = TypeVar("_Model", bound="ComposerModel")


class TrainerModel(nn.Module):
    """Base class giving a model the Trainer's optional hooks: eval forward and metrics."""

    def loss(self, outputs: Any, batch: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define loss(outputs, batch).")

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """Outputs for evaluation; by default the training forward (reusing ``outputs`` when given)."""
        return outputs if outputs is not None else self(batch)

    def get_metrics(self, is_train: bool = False) -> Mapping[str, Any]:
        """Metric objects by name: torchmetrics ``Metric``s or callables ``(outputs, batch) -> number``."""
        return {}

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        """Feed one batch to ``metric``; the default passes ``(outputs, targets)``, targets being ``batch[1]``."""
        metric.update(outputs, batch_targets(batch))


class ComposerModel(TrainerModel):
    """Composer's name for :class:`TrainerModel`: subclass it and write ``forward(batch)`` and ``loss(outputs, batch)``.

    One addition, for code written from Composer's documentation: the ``nn.Module`` machinery is set up when the
    object is created, so a subclass whose ``__init__`` leaves out ``super().__init__()`` (as the ResNet-18 example
    of Composer's Trainer guide does) still works, instead of failing with ``cannot assign module before
    Module.__init__() call`` at its first submodule. A subclass that calls ``super().__init__()`` first, as usual,
    is unaffected (nothing was assigned yet when it runs again).
    """

    def __new__(cls: type[_Model], *args: Any, **kwargs: Any) -> _Model:
        model = super().__new__(cls)
        nn.Module.__init__(model)
        return model


def batch_targets(batch: Any) -> Any:
    """The targets of an ``(inputs, targets)`` batch, or ``batch["targets"]``/``["labels"]`` of a mapping."""
    if isinstance(batch, Mapping):
        for key in ("targets", "target", "labels", "label", "y"):
            if key in batch:
                return batch[key]
        raise KeyError(f"No targets in a batch with keys {sorted(batch)}; define update_metric() on the model.")
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return batch[1]
    raise TypeError(
        f"Cannot find the targets in a {type(batch).__name__} batch; define update_metric(batch, outputs, metric) "
        "on the model."
    )
