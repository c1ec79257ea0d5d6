"""LowPrecisionGroupNorm: GroupNorm computed in the autocast dtype, instead of being up-cast to float32.

Under ``torch.autocast``, ``group_norm`` runs in float32 (CUDA autocast up-casts its inputs; CPU autocast
keeps float32 inputs in float32), with a float32 output. Each
``nn.GroupNorm`` becomes an :class:`LPGroupNorm` that, while autocast is active on the input's device, casts
its input, weight and bias to the autocast dtype and normalises in that dtype (output in that dtype);
outside autocast it is exactly ``nn.GroupNorm``. From Composer's method of the same name (MosaicML, no paper).

Fires once, at ``Event.INIT``, and only for a mixed precision (``"16-mixed"``/``"bf16-mixed"``, Composer's
``"amp_fp16"``/``"amp_bf16"``/``"amp"``): with any other precision it warns that it has no effect and leaves
the model alone, as Composer does. The replacements share the original parameters (same objects and
state-dict keys), so optimizers and checkpoints need no change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.algorithms.low_precision_layernorm import (
    LowPrecisionNorm,
    autocast_dtype,
    cast_to,
    is_mixed_precision,
    replace_norms,
    warn_no_effect,
)
from fabric.trainer.surgery import share_tensors


class LPGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` that runs in the autocast dtype while autocast is active (see the module docstring)."""

    @classmethod
    def from_groupnorm(cls, groupnorm: nn.GroupNorm) -> LPGroupNorm:
        """The low-precision version of ``groupnorm``, sharing its parameters."""
        low = cls(
            groupnorm.num_groups, groupnorm.num_channels, eps=groupnorm.eps, affine=groupnorm.affine, device="meta"
        )
        return share_tensors(groupnorm, low)

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(input)
        if dtype is None:
            return super().forward(input)
        with torch.autocast(input.device.type, enabled=False):
            weight, bias = cast_to(self.weight, dtype), cast_to(self.bias, dtype)
            return F.group_norm(input.to(dtype), self.num_groups, weight, bias, self.eps)


def apply_low_precision_groupnorm(
    model: nn.Module, precision: str, optimizers: Sequence[Optimizer] = ()
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace ``model``'s ``nn.GroupNorm`` modules by :class:`LPGroupNorm`, in place; returns what was replaced.

    With a ``precision`` that is not mixed, warns and changes nothing (see the module docstring). The
    replacements share the original parameters, so ``optimizers`` need no change.
    """
    if not is_mixed_precision(precision):
        warn_no_effect("LowPrecisionGroupNorm", precision)
        return {}
    return _replace_groupnorms(model, optimizers)


def _replace_groupnorms(model: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, tuple[nn.Module, nn.Module]]:
    return replace_norms(model, nn.GroupNorm, LPGroupNorm.from_groupnorm, optimizers)


class LowPrecisionGroupNorm(LowPrecisionNorm):
    """GroupNorm in the autocast dtype, set up at INIT for mixed precision (see the module docstring)."""

    norm_type = nn.GroupNorm

    @override
    def replace(self, model: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, tuple[nn.Module, nn.Module]]:
        return _replace_groupnorms(model, optimizers)
