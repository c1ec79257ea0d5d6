"""ChannelsLast: store the model's 4-d tensors as NHWC (``torch.channels_last``).

Convolutions on GPUs with tensor cores (and oneDNN on many CPUs) run faster on NHWC data; the
arithmetic is unchanged. Fires once, at ``Event.INIT``: parameters and buffers of 4 dimensions are
converted, and inputs follow through the convolutions. It only changes memory layout, so a checkpoint
saved with it loads into any model (``changes_module_structure`` is False). From Composer's
``ChannelsLast`` (no paper; see PyTorch's channels-last memory-format tutorial).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from fabric.trainer.algorithms.surgery import SurgeryAlgorithm


def apply_channels_last(model: nn.Module) -> nn.Module:
    """Convert ``model``'s 4-d parameters and buffers to channels-last, in place; returns ``model``.

    Parameters keep their identity (``Module.to`` swaps their data), so optimizers need no update.
    """
    cast(Any, model).to(memory_format=torch.channels_last)  # the stubs of Module.to lack memory_format
    return model


class ChannelsLast(SurgeryAlgorithm):
    """Converts the model to ``torch.channels_last`` at INIT (see the module docstring)."""

    changes_module_structure = False

    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        apply_channels_last(model)

    def hparams(self) -> dict[str, Any]:
        return {}
