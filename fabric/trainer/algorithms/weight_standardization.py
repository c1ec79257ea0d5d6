"""WeightStandardization: convolutions use their weights standardised per output channel.

Each output channel's filter is shifted and scaled to zero mean and unit variance before every use,
``W_hat = (W - mean(W)) / sqrt(var(W) + eps)`` (over input channels and kernel positions), which smooths
the loss landscape and helps training, especially with small-batch normalisation (Qiao et al.,
"Micro-Batch Training with Batch-Channel Normalization and Weight Standardization", 2019).

Fires once, at ``Event.INIT``: registers a ``torch.nn.utils.parametrize`` parametrization on the weight
of every ``Conv1d/2d/3d``, except the last ``n_last_layers_ignore`` of them (in the model's module
order; a convolutional classifier head is often best left alone). The parameters stay the same
objects, so optimizers need no update; the state-dict key of each weight becomes
``parametrizations.weight.original``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.surgery import SurgeryAlgorithm

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class StandardizeWeight(nn.Module):
    """The parametrization: standardise each output channel's weights (dimension 0) to mean 0, variance 1."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    @override
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(weight, dim=list(range(1, weight.dim())), keepdim=True, correction=0)
        return (weight - mean) / torch.sqrt(var + self.eps)


def _check_ignored(n_last_layers_ignore: int) -> None:
    if isinstance(n_last_layers_ignore, bool) or not isinstance(n_last_layers_ignore, int) or n_last_layers_ignore < 0:
        raise ValueError(f"n_last_layers_ignore must be a non-negative integer, got {n_last_layers_ignore!r}.")


def apply_weight_standardization(model: nn.Module, n_last_layers_ignore: int = 0) -> list[str]:
    """Standardise the weights of ``model``'s convolutions in place; returns the names of those changed.

    Convolutions whose weight is already parametrized (by this or anything else) are left alone.
    """
    _check_ignored(n_last_layers_ignore)
    convolutions = [(name, module) for name, module in model.named_modules() if isinstance(module, _CONVOLUTIONS)]
    chosen = convolutions[: max(0, len(convolutions) - n_last_layers_ignore)]
    standardized = []
    for name, conv in chosen:
        if not parametrize.is_parametrized(conv, "weight"):
            parametrize.register_parametrization(conv, "weight", StandardizeWeight())
            standardized.append(name)
    return standardized


class WeightStandardization(SurgeryAlgorithm):
    """Weight standardization of convolutions, set up at INIT (see the module docstring)."""

    def __init__(self, n_last_layers_ignore: int = 0) -> None:
        _check_ignored(n_last_layers_ignore)
        self.n_last_layers_ignore = n_last_layers_ignore

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        if not apply_weight_standardization(model, self.n_last_layers_ignore):
            warnings.warn(
                f"WeightStandardization found no convolution to standardise in {type(model).__name__} "
                f"(n_last_layers_ignore={self.n_last_layers_ignore}).",
                stacklevel=2,
            )

    @override
    def hparams(self) -> dict[str, Any]:
        return {"n_last_layers_ignore": self.n_last_layers_ignore}
