"""BlurPool: anti-aliased downsampling, by low-pass filtering next to every strided conv and max-pool.

Strided convolutions and max-pools subsample without first removing high frequencies, so a one-pixel
shift of the input can change the output a lot (aliasing). Blurring with a small binomial filter
around the subsampling makes networks more shift-invariant and usually more accurate (Zhang, "Making
Convolutional Networks Shift-Invariant Again", ICML 2019).

Fires once, at ``Event.INIT``. Replaces

- every ``nn.Conv2d`` with a stride above 1 and at least ``min_channels`` input channels by a
  :class:`BlurConv2d`: with ``blur_first`` the input is blurred and the conv keeps its stride (cheap);
  otherwise the conv runs with stride 1 and a strided blur subsamples its output (the paper's form,
  costlier by the stride squared);
- every ``nn.MaxPool2d`` with a stride above 1 (and no dilation or ceil mode) by a
  :class:`MaxBlurPool2d`: a stride-1 max-pool followed by a strided blur.

Output shapes are unchanged, and the replacements keep the original parameter objects and state-dict
keys (the filter is a constant), so optimizers need no update.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.surgery import ModuleFactory, SurgeryAlgorithm, replace_modules, share_tensors


def blur_2d(images: torch.Tensor, stride: int | tuple[int, int] = 1) -> torch.Tensor:
    """Low-pass filter each channel of ``images`` (N, C, H, W) with the 3x3 binomial filter, then subsample.

    Edges are padded by replication, so a constant image stays constant. With stride ``s`` the output
    is ``floor((H - 1) / s) + 1`` high, the size of a stride-``s`` conv with kernel 3 and padding 1.
    """
    taps = torch.tensor([1.0, 2.0, 1.0], dtype=images.dtype, device=images.device)
    kernel = (torch.outer(taps, taps) / 16).expand(images.shape[1], 1, 3, 3)
    padded = F.pad(images, (1, 1, 1, 1), mode="replicate")
    return F.conv2d(padded, kernel, stride=stride, groups=images.shape[1])


class BlurConv2d(nn.Conv2d):
    """A strided ``Conv2d`` with a blur before it (``blur_first``) or a strided blur after a stride-1 conv."""

    def __init__(self, *args: Any, blur_first: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.blur_first = blur_first
        self.blur_stride: tuple[int, int] = (1, 1)
        if not blur_first:  # the conv runs densely; the blur subsamples
            self.blur_stride, self.stride = (int(self.stride[0]), int(self.stride[1])), (1, 1)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, blur_first: bool = True) -> BlurConv2d:
        """The blurred version of ``conv``, sharing its weight and bias."""
        blurred = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device="meta",
            blur_first=blur_first,
        )
        return share_tensors(conv, blurred)

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.blur_first:
            return super().forward(blur_2d(input))
        return blur_2d(super().forward(input), self.blur_stride)

    @override
    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[no-untyped-call]
        return f"{base}, blur_first={self.blur_first}, blur_stride={self.blur_stride}"


class MaxBlurPool2d(nn.Module):
    """A max-pool evaluated densely (stride 1), then subsampled by a strided blur: same output size."""

    def __init__(self, kernel_size: int | tuple[int, int], stride: int | tuple[int, int], padding: Any = 0) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    @classmethod
    def from_maxpool(cls, pool: nn.MaxPool2d) -> MaxBlurPool2d:
        return cls(pool.kernel_size, pool.stride, pool.padding)

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return blur_2d(F.max_pool2d(input, self.kernel_size, stride=1, padding=self.padding), self.stride)

    @override
    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


def _is_strided(stride: int | tuple[int, ...]) -> bool:
    return any(s > 1 for s in ((stride,) if isinstance(stride, int) else stride))


def apply_blurpool(
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    replace_convs: bool = True,
    replace_maxpools: bool = True,
    blur_first: bool = True,
    min_channels: int = 16,
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Add anti-aliasing to ``model`` in place (see the module docstring); returns what was replaced.

    ``optimizers`` is accepted for symmetry with the other surgery functions: the replacements keep
    the original parameters, so no optimizer changes.
    """

    def blur_conv(conv: nn.Module, name: str) -> nn.Module | None:
        assert isinstance(conv, nn.Conv2d)
        if not _is_strided(conv.stride) or conv.in_channels < min_channels:
            return None
        return BlurConv2d.from_conv(conv, blur_first)

    def blur_maxpool(pool: nn.Module, name: str) -> nn.Module | None:
        assert isinstance(pool, nn.MaxPool2d)
        if not _is_strided(pool.stride) or pool.ceil_mode or pool.dilation not in (1, (1, 1)):
            return None
        return MaxBlurPool2d.from_maxpool(pool)

    policy: dict[type[nn.Module], ModuleFactory] = {}
    if replace_convs:
        policy[nn.Conv2d] = blur_conv
    if replace_maxpools:
        policy[nn.MaxPool2d] = blur_maxpool
    return replace_modules(model, policy, optimizers)


class BlurPool(SurgeryAlgorithm):
    """Anti-aliased downsampling at INIT (see the module docstring)."""

    def __init__(
        self, replace_convs: bool = True, replace_maxpools: bool = True, blur_first: bool = True, min_channels: int = 16
    ) -> None:
        if not (replace_convs or replace_maxpools):
            raise ValueError("BlurPool with replace_convs=False and replace_maxpools=False would change nothing.")
        if isinstance(min_channels, bool) or not isinstance(min_channels, int) or min_channels < 0:
            raise ValueError(f"min_channels must be a non-negative integer, got {min_channels!r}.")
        self.replace_convs, self.replace_maxpools = replace_convs, replace_maxpools
        self.blur_first, self.min_channels = blur_first, min_channels

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        replaced = apply_blurpool(model, optimizers, **self.hparams())
        if not replaced:
            warnings.warn(
                f"BlurPool found no strided Conv2d (with >= {self.min_channels} input channels) or MaxPool2d "
                f"to replace in {type(model).__name__}; it has no effect.",
                stacklevel=2,
            )

    @override
    def hparams(self) -> dict[str, Any]:
        return {
            "replace_convs": self.replace_convs,
            "replace_maxpools": self.replace_maxpools,
            "blur_first": self.blur_first,
            "min_channels": self.min_channels,
        }
