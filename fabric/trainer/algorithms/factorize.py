"""Factorize: replace large Linear and Conv2d layers by low-rank pairs, for fewer FLOPs per step.

A ``Linear(in, out)`` becomes ``Linear(in, r)`` then ``Linear(r, out)``; a ``Conv2d(in, out, k)``
becomes ``Conv2d(in, r, k)`` then a 1x1 ``Conv2d(r, out)``. Both factors are initialised from the
truncated SVD of the original weight ``W = U S V^T`` (the first factor is ``sqrt(S_r) V_r^T``, the
second ``U_r sqrt(S_r)``), so the pair computes the best rank-``r`` approximation of the original
layer, and exactly the original when ``r`` is the weight's full rank. This is Composer's
``Factorize``; the idea is from Jaderberg, Vedaldi and Zisserman, "Speeding up Convolutional Neural
Networks with Low Rank Expansions" (BMVC 2014) and Zhang et al. (TPAMI 2016).

Fires once, at ``Event.INIT``. A layer is factorized when both its input and output sizes are at least
``min_channels`` (convs) / ``min_features`` (linears), it is an ungrouped conv, and the factorized pair
needs fewer multiply-adds than the original. ``latent_channels`` / ``latent_features`` is the rank
``r``: a float in (0, 1] is a fraction of ``min(in, out)``, an int is a count. The new parameters are
swapped into the optimizers in place of the old ones.

Only plain ``nn.Linear``/``nn.Conv2d`` modules are factorized (exact class): a layer another surgery
already changed (a ``BlurConv2d``, a conv with standardised weights) keeps that change and is left
alone, so with BlurPool or WeightStandardization listed first those layers stay unfactorized.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.algorithms.transformer_paths import disable_fused_transformer_paths
from fabric.trainer.surgery import ModuleFactory, SurgeryAlgorithm, replace_modules


def _low_rank_factors(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, second)`` with ``second @ first`` the best rank-``rank`` approximation of ``matrix`` (out x in)."""
    full_rank = min(matrix.shape)
    if not 1 <= rank <= full_rank:
        raise ValueError(f"rank must be between 1 and {full_rank} for a {tuple(matrix.shape)} weight, got {rank}.")
    u, s, vh = torch.linalg.svd(matrix.detach().double(), full_matrices=False)
    root = s[:rank].sqrt()
    first = root[:, None] * vh[:rank]
    second = u[:, :rank] * root[None, :]
    return first.to(matrix.dtype), second.to(matrix.dtype)


class _LowRankPair(nn.Module):
    """Two layers applied in sequence, ``first`` projecting to ``rank`` features and ``second`` expanding back."""

    first: nn.Linear | nn.Conv2d
    second: nn.Linear | nn.Conv2d

    def __init__(self, original: nn.Module, rank: int) -> None:
        super().__init__()

    @classmethod
    def from_original(cls, original: nn.Linear | nn.Conv2d, rank: int) -> _LowRankPair:
        """The rank-``rank`` truncated-SVD factorization of ``original`` (exact at the weight's full rank)."""
        factorized = cls(original, rank)
        first, second = _low_rank_factors(original.weight.flatten(1), rank)
        with torch.no_grad():
            factorized.first.weight.copy_(first.view_as(factorized.first.weight))
            factorized.second.weight.copy_(second.view_as(factorized.second.weight))
            if original.bias is not None and factorized.second.bias is not None:
                factorized.second.bias.copy_(original.bias)
        return factorized

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.second(self.first(input))
        return output


class FactorizedLinear(_LowRankPair):
    """``Linear(in, out)`` as ``Linear(in, rank, bias=False)`` followed by ``Linear(rank, out)``."""

    def __init__(self, linear: nn.Linear, rank: int) -> None:
        super().__init__(linear, rank)
        like: dict[str, Any] = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.first = nn.Linear(linear.in_features, rank, bias=False, **like)
        self.second = nn.Linear(rank, linear.out_features, bias=linear.bias is not None, **like)


class FactorizedConv2d(_LowRankPair):
    """``Conv2d(in, out, k)`` as ``Conv2d(in, rank, k, bias=False)`` followed by a 1x1 ``Conv2d(rank, out)``.

    Only ungrouped convolutions (``groups == 1``) can be factorized this way.
    """

    def __init__(self, conv: nn.Conv2d, rank: int) -> None:
        if conv.groups != 1:
            raise ValueError(f"Only ungrouped convolutions can be factorized, got groups={conv.groups}.")
        super().__init__(conv, rank)
        like: dict[str, Any] = {"device": conv.weight.device, "dtype": conv.weight.dtype}
        geometry: dict[str, Any] = {
            "kernel_size": conv.kernel_size,
            "stride": conv.stride,
            "padding": conv.padding,
            "dilation": conv.dilation,
            "padding_mode": conv.padding_mode,
        }
        self.first = nn.Conv2d(conv.in_channels, rank, bias=False, **geometry, **like)
        self.second = nn.Conv2d(rank, conv.out_channels, 1, bias=conv.bias is not None, **like)


def _check_arguments(min_channels: int, latent_channels: float, min_features: int, latent_features: float) -> None:
    for name, latent in (("latent_channels", latent_channels), ("latent_features", latent_features)):
        is_count = isinstance(latent, numbers.Integral) and not isinstance(latent, bool) and latent >= 1
        is_fraction = isinstance(latent, float) and 0 < latent <= 1
        if not (is_count or is_fraction):
            raise ValueError(f"{name} must be a fraction in (0, 1] or a positive integer, got {latent!r}.")
    for name, minimum in (("min_channels", min_channels), ("min_features", min_features)):
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 1:
            raise ValueError(f"{name} must be a positive integer, got {minimum!r}.")


def _rank(latent: float, in_size: int, out_size: int) -> int:
    """The rank ``latent`` asks for: a fraction of ``min(in, out)`` or a count, at least 1."""
    if isinstance(latent, numbers.Integral):
        return int(latent)
    return max(1, round(float(latent) * min(in_size, out_size)))


def apply_factorization(
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    factorize_convs: bool = True,
    factorize_linears: bool = True,
    min_channels: int = 256,
    latent_channels: float = 0.25,
    min_features: int = 256,
    latent_features: float = 0.25,
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Factorize ``model``'s eligible layers in place (see the module docstring); returns what was replaced."""
    _check_arguments(min_channels, latent_channels, min_features, latent_features)

    def factorize_conv(conv: nn.Module, name: str) -> nn.Module | None:
        assert isinstance(conv, nn.Conv2d)
        if conv.groups != 1 or min(conv.in_channels, conv.out_channels) < min_channels:
            return None
        rank = _rank(latent_channels, conv.in_channels, conv.out_channels)
        window = conv.in_channels * math.prod(conv.kernel_size)
        if rank * (window + conv.out_channels) >= window * conv.out_channels:
            return None  # no fewer multiply-adds
        return FactorizedConv2d.from_original(conv, rank)

    def factorize_linear(linear: nn.Module, name: str) -> nn.Module | None:
        assert isinstance(linear, nn.Linear)
        if min(linear.in_features, linear.out_features) < min_features:
            return None
        rank = _rank(latent_features, linear.in_features, linear.out_features)
        if rank * (linear.in_features + linear.out_features) >= linear.in_features * linear.out_features:
            return None
        return FactorizedLinear.from_original(linear, rank)

    policy: dict[type[nn.Module], ModuleFactory] = {}
    if factorize_convs:
        policy[nn.Conv2d] = factorize_conv
    if factorize_linears:
        policy[nn.Linear] = factorize_linear
    replaced = replace_modules(model, policy, optimizers)
    disable_fused_transformer_paths(model)  # they would read a factorized linear1/linear2's missing weight
    return replaced


class Factorize(SurgeryAlgorithm):
    """Low-rank factorization of large Linear and Conv2d layers at INIT (see the module docstring)."""

    def __init__(
        self,
        factorize_convs: bool = True,
        factorize_linears: bool = True,
        min_channels: int = 256,
        latent_channels: float = 0.25,
        min_features: int = 256,
        latent_features: float = 0.25,
    ) -> None:
        if not (factorize_convs or factorize_linears):
            raise ValueError("Factorize with factorize_convs=False and factorize_linears=False would change nothing.")
        _check_arguments(min_channels, latent_channels, min_features, latent_features)
        self.factorize_convs, self.factorize_linears = factorize_convs, factorize_linears
        self.min_channels, self.latent_channels = min_channels, latent_channels
        self.min_features, self.latent_features = min_features, latent_features

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        if not apply_factorization(model, optimizers, **self.hparams()):
            warnings.warn(
                f"Factorize found no layer of {type(model).__name__} large enough to factorize with a saving "
                f"(min_channels={self.min_channels}, min_features={self.min_features}).",
                stacklevel=2,
            )

    @override
    def hparams(self) -> dict[str, Any]:
        return {
            "factorize_convs": self.factorize_convs,
            "factorize_linears": self.factorize_linears,
            "min_channels": self.min_channels,
            "latent_channels": self.latent_channels,
            "min_features": self.min_features,
            "latent_features": self.latent_features,
        }
