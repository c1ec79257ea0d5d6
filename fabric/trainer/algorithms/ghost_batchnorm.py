"""GhostBatchNorm: batch normalization over small "ghost" batches inside a large batch.

With large batches, BatchNorm statistics are so precise that they stop regularising; normalising
each slice of ``ghost_batch_size`` samples with its own statistics restores the noise of small-batch
training and improves generalisation (Hoffer, Hubara and Soudry, "Train longer, generalize better",
NeurIPS 2017).

Fires once, at ``Event.INIT``: every ``nn.BatchNorm1d/2d/3d`` becomes a ``GhostBatchNorm1d/2d/3d``
sharing its parameters and running statistics (the state dict is unchanged). In training, the batch
is cut into ``ceil(N / ghost_batch_size)`` near-equal slices (``torch.chunk``), each normalised with its
own mean and variance; the running statistics take one momentum step per batch towards the
size-weighted average of the slices' means and unbiased variances. In evaluation a GhostBatchNorm is
exactly the BatchNorm it replaced.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.surgery import ModuleFactory, SurgeryAlgorithm, replace_modules, share_tensors


class _GhostBatchNorm(_BatchNorm):
    """The training-time forward shared by the 1d, 2d and 3d variants."""

    ghost_batch_size: int = 32

    @classmethod
    def from_batchnorm(cls, batchnorm: _BatchNorm, ghost_batch_size: int) -> _GhostBatchNorm:
        """The ghost version of ``batchnorm``, sharing its parameters and running statistics."""
        ghost = cls(
            batchnorm.num_features,
            eps=batchnorm.eps,
            momentum=batchnorm.momentum,
            affine=batchnorm.affine,
            track_running_stats=batchnorm.track_running_stats,
            device="meta",
        )
        ghost.ghost_batch_size = ghost_batch_size
        return share_tensors(batchnorm, ghost)

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)  # type: ignore[no-untyped-call]
        slices = input.chunk(math.ceil(input.shape[0] / self.ghost_batch_size))
        normalized = [F.batch_norm(s, None, None, self.weight, self.bias, True, 0.0, self.eps) for s in slices]
        if self.track_running_stats:
            self._update_running_stats(slices)
        return torch.cat(normalized)

    @torch.no_grad()
    def _update_running_stats(self, slices: Sequence[torch.Tensor]) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        channel_dims = [0, *range(2, slices[0].dim())]
        total = sum(s.shape[0] for s in slices)
        mean = torch.zeros_like(self.running_mean)
        var = torch.zeros_like(self.running_var)
        for s in slices:
            slice_var, slice_mean = torch.var_mean(s.float(), dim=channel_dims, correction=1)
            mean += slice_mean * (s.shape[0] / total)
            var += slice_var * (s.shape[0] / total)
        self.running_mean.lerp_(mean, factor)
        self.running_var.lerp_(var, factor)

    @override
    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[no-untyped-call]
        return f"{base}, ghost_batch_size={self.ghost_batch_size}"


class GhostBatchNorm1d(_GhostBatchNorm, nn.BatchNorm1d):
    """``BatchNorm1d`` normalising ghost batches in training."""


class GhostBatchNorm2d(_GhostBatchNorm, nn.BatchNorm2d):
    """``BatchNorm2d`` normalising ghost batches in training."""


class GhostBatchNorm3d(_GhostBatchNorm, nn.BatchNorm3d):
    """``BatchNorm3d`` normalising ghost batches in training."""


_GHOST_OF: dict[type[nn.Module], type[_GhostBatchNorm]] = {
    nn.BatchNorm1d: GhostBatchNorm1d,
    nn.BatchNorm2d: GhostBatchNorm2d,
    nn.BatchNorm3d: GhostBatchNorm3d,
}


def _check_ghost_batch_size(ghost_batch_size: int) -> None:
    if isinstance(ghost_batch_size, bool) or not isinstance(ghost_batch_size, int) or ghost_batch_size < 1:
        raise ValueError(f"ghost_batch_size must be a positive integer, got {ghost_batch_size!r}.")


def apply_ghost_batchnorm(
    model: nn.Module, ghost_batch_size: int = 32, optimizers: Sequence[Optimizer] = ()
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace ``model``'s BatchNorm1d/2d/3d by ghost versions, in place; returns what was replaced.

    The replacements share the original parameters, so ``optimizers`` need no change.
    """
    _check_ghost_batch_size(ghost_batch_size)

    def factory_for(ghost_class: type[_GhostBatchNorm]) -> ModuleFactory:
        def make(module: nn.Module, name: str) -> nn.Module:
            assert isinstance(module, _BatchNorm)
            return ghost_class.from_batchnorm(module, ghost_batch_size)

        return make

    policy = {batchnorm: factory_for(ghost) for batchnorm, ghost in _GHOST_OF.items()}
    return replace_modules(model, policy, optimizers)


class GhostBatchNorm(SurgeryAlgorithm):
    """Ghost batch normalization, set up at INIT (see the module docstring)."""

    def __init__(self, ghost_batch_size: int = 32) -> None:
        _check_ghost_batch_size(ghost_batch_size)
        self.ghost_batch_size = ghost_batch_size

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        if not apply_ghost_batchnorm(model, self.ghost_batch_size, optimizers):
            warnings.warn(f"GhostBatchNorm found no BatchNorm1d/2d/3d in {type(model).__name__}.", stacklevel=2)

    @override
    def hparams(self) -> dict[str, Any]:
        return {"ghost_batch_size": self.ghost_batch_size}
