"""ChannelsLast: store the model's 4-d tensors as NHWC (``torch.channels_last``).

Convolutions on GPUs with tensor cores (and oneDNN on many CPUs) run faster on NHWC data; the
arithmetic is unchanged. Fires once, at ``Event.INIT``, after every surgery that changes the model's
structure (so the modules those create are converted too): parameters and buffers of 4 dimensions are
converted, and inputs follow through the convolutions. It only changes memory layout, so a checkpoint
saved with it loads into any model (``changes_module_structure`` is False). From Composer's
``ChannelsLast`` (no paper; see PyTorch's channels-last memory-format tutorial).

A CPU kernel bug is routed around. torch 2.13's oneDNN, on CPUs without AVX-512 (or with
``ONEDNN_MAX_CPU_ISA=AVX2``), corrupts the heap or returns wrong gradients in the weight gradient of a
1x1 convolution with stride above 1 and no padding on NHWC data (its "reduce to unit stride" path):
the process dies with ``double free or corruption``, or, with 2 threads, trains on wrong gradients.
Such a convolution equals a stride-1 1x1 convolution of the input subsampled by the stride, which
takes oneDNN's unit-stride kernel; so converted convolutions compute it that way on CPU tensors. The
result is the same sums, and the step is no slower (``benchmarks/channels_last.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.surgery import SurgeryAlgorithm


class SubsampledPointwiseConv:
    """``_conv_forward`` of a 1x1, strided, unpadded ``Conv2d``: subsample the input, then a stride-1 conv.

    Installed as an instance attribute, so it works for ``Conv2d`` subclasses that call ``_conv_forward``
    (e.g. BlurPool's ``BlurConv2d``); it holds plain numbers only, so modules still copy and pickle.
    Tensors off the CPU take the original strided convolution.
    """

    def __init__(self, stride: tuple[int, int], groups: int) -> None:
        self.stride, self.groups = stride, groups

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if weight.device.type != "cpu":
            return F.conv2d(input, weight, bias, self.stride, 0, 1, self.groups)
        rows, columns = self.stride
        return F.conv2d(input[..., ::rows, ::columns], weight, bias, 1, 0, 1, self.groups)


def _is_strided_pointwise(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Conv2d)
        and tuple(module.kernel_size) == (1, 1)
        and tuple(module.stride) != (1, 1)
        and module.padding in ((0, 0), "valid")
    )


def apply_channels_last(model: nn.Module) -> nn.Module:
    """Convert ``model``'s 4-d parameters and buffers to channels-last, in place; returns ``model``.

    Parameters keep their identity (``Module.to`` swaps their data), so optimizers need no update.
    Strided 1x1 convolutions are routed around the CPU kernel bug described in the module docstring.
    """
    cast(Any, model).to(memory_format=torch.channels_last)  # the stubs of Module.to lack memory_format
    for module in model.modules():
        # torch-workaround(onednn-avx2-strided-1x1-grad): oneDNN's AVX2 kernel gets this weight gradient wrong
        if _is_strided_pointwise(module):
            conv = cast(nn.Conv2d, module)
            stride = (int(conv.stride[0]), int(conv.stride[1]))
            conv._conv_forward = SubsampledPointwiseConv(stride, conv.groups)  # type: ignore[method-assign]
    return model


class ChannelsLast(SurgeryAlgorithm):
    """Converts the model to ``torch.channels_last`` at INIT (see the module docstring)."""

    changes_module_structure = False

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        apply_channels_last(model)

    @override
    def hparams(self) -> dict[str, Any]:
        return {}
