"""SqueezeExcite: a squeeze-and-excitation block after the wide convolutions of a network.

Hu et al., "Squeeze-and-Excitation Networks" (CVPR 2018): a block averages each channel over the image
("squeeze"), feeds the channel vector through a two-layer MLP (``C -> latent -> C``, ReLU, then sigmoid) and
scales each channel of its input by the result ("excitation"), so a layer can use information from the whole
image. Composer's arguments: a block is added after every ``nn.Conv2d`` whose ``min(in_channels,
out_channels)`` is at least ``min_channels``; its hidden layer has ``latent_channels`` units, or that fraction
of the conv's output channels when ``latent_channels < 1`` (at least one unit).

Fires once, at ``Event.INIT``: each chosen conv becomes a :class:`SqueezeExciteConv2d` holding it (as
``conv``, same parameter objects) and the new block (``se``); the optimizers get the block's new parameters
(in the conv's parameter group). State-dict keys of the conv gain a ``conv.`` level, so a checkpoint records
the surgery and re-applies it on load.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.surgery import SurgeryAlgorithm, replace_modules


def latent_size(latent_channels: float, num_features: int) -> int:
    """Hidden units of the block: ``latent_channels`` itself, or that fraction of ``num_features`` if below 1."""
    return max(1, int(latent_channels if latent_channels >= 1 else latent_channels * num_features))


class SqueezeExcite2d(nn.Module):
    """Scale each channel of ``(N, C, H, W)`` inputs by ``sigmoid(W2 relu(W1 mean_hw(x)))``."""

    def __init__(self, num_features: int, latent_channels: float = 0.125) -> None:
        super().__init__()
        self.latent_channels = latent_size(latent_channels, num_features)
        self.pool_and_mlp = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(num_features, self.latent_channels, bias=False),
            nn.ReLU(),
            nn.Linear(self.latent_channels, num_features, bias=False),
            nn.Sigmoid(),
        )

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        scale: torch.Tensor = self.pool_and_mlp(input)
        return input * scale.view(*scale.shape, 1, 1)


class SqueezeExciteConv2d(nn.Module):
    """A ``Conv2d`` followed by a :class:`SqueezeExcite2d` over its output channels."""

    def __init__(self, conv: nn.Conv2d, latent_channels: float = 0.125) -> None:
        super().__init__()
        self.conv = conv
        self.se = SqueezeExcite2d(conv.out_channels, latent_channels)
        self.se.to(device=conv.weight.device, dtype=conv.weight.dtype)

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.se(self.conv(input))
        return output


def _check(latent_channels: float, min_channels: int) -> None:
    if isinstance(latent_channels, bool) or not isinstance(latent_channels, int | float) or not latent_channels > 0:
        raise ValueError(
            f"latent_channels={latent_channels!r} must be a positive number: units, or a fraction of the channels "
            "if below 1."
        )
    if isinstance(min_channels, bool) or not isinstance(min_channels, int) or min_channels < 0:
        raise ValueError(f"min_channels={min_channels!r} must be a non-negative integer.")


def apply_squeeze_excite(
    model: nn.Module, latent_channels: float = 64, min_channels: int = 128, optimizers: Sequence[Optimizer] = ()
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Add a squeeze-excite block after each wide enough ``nn.Conv2d`` of ``model``, in place (see the module
    docstring); ``optimizers`` get the new parameters. Returns what was replaced."""
    _check(latent_channels, min_channels)

    excited = {id(module.conv) for module in model.modules() if isinstance(module, SqueezeExciteConv2d)}

    def excite(conv: nn.Module, name: str) -> nn.Module | None:
        assert isinstance(conv, nn.Conv2d)
        if id(conv) in excited or min(conv.in_channels, conv.out_channels) < min_channels:
            return None  # already followed by a block (a second application adds none), or too narrow
        return SqueezeExciteConv2d(conv, latent_channels)

    return replace_modules(model, {nn.Conv2d: excite}, optimizers)


class SqueezeExcite(SurgeryAlgorithm):
    """Squeeze-and-excitation blocks added at INIT (see the module docstring)."""

    def __init__(self, latent_channels: float = 64, min_channels: int = 128) -> None:
        _check(latent_channels, min_channels)
        self.latent_channels, self.min_channels = latent_channels, min_channels

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        if not apply_squeeze_excite(model, self.latent_channels, self.min_channels, optimizers):
            warnings.warn(
                f"SqueezeExcite found no nn.Conv2d with min(in_channels, out_channels) >= {self.min_channels} in "
                f"{type(model).__name__}; it has no effect.",
                stacklevel=2,
            )

    @override
    def hparams(self) -> dict[str, Any]:
        return {"latent_channels": self.latent_channels, "min_channels": self.min_channels}
