"""LowPrecisionLayerNorm: LayerNorm computed in the autocast dtype, instead of being up-cast to float32.

Under ``torch.autocast``, ``layer_norm`` runs in float32 (CUDA autocast up-casts its inputs; CPU autocast
keeps float32 inputs in float32), with a float32 output, which costs memory traffic and a cast back for the
next half-precision op. Each ``nn.LayerNorm`` becomes an :class:`LPLayerNorm`
that, while autocast is active on the input's device, casts its input, weight and bias to the autocast dtype
and normalises in that dtype (output in that dtype); outside autocast it is exactly ``nn.LayerNorm``. From
Composer's method of the same name (MosaicML, no paper), which can speed up mixed-precision training of
transformers at a small numerical cost.

Fires once, at ``Event.INIT``, and only for a mixed precision (``"16-mixed"``/``"bf16-mixed"``, Composer's
``"amp_fp16"``/``"amp_bf16"``/``"amp"``): with any other precision it warns that it has no effect and leaves
the model alone, as Composer does. The replacements share the original parameters (same objects and
state-dict keys), so optimizers and checkpoints need no change.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State
from fabric.trainer.surgery import SurgeryAlgorithm, replace_modules, share_tensors


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes in on ``tensor``'s device, or None when autocast is off there."""
    device_type = tensor.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_to(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return tensor if tensor is None or dtype is None else tensor.to(dtype)


def is_mixed_precision(precision: str) -> bool:
    """Whether ``precision`` (Fabric's or Composer's spelling) computes under autocast."""
    from fabric.plugins.precision.dtypes import mixed_dtype
    from fabric.plugins.precision.registry import parse_precision

    if precision == "amp":  # Composer's name for float16 autocast
        return True
    try:
        return mixed_dtype(parse_precision(precision)) is not None
    except ValueError:
        return False


def run_precision(state: State) -> str:
    """The canonical name of the precision the Trainer's Fabric runs with (``"32-true"`` when unknown)."""
    precision = getattr(getattr(state.fabric, "strategy", None), "precision", None)
    return str(getattr(precision, "name", "32-true"))


def warn_no_effect(method: str, precision: str) -> None:
    warnings.warn(
        f"{method} only applies with a mixed precision ('16-mixed', 'bf16-mixed'; Composer's 'amp_fp16', "
        f"'amp_bf16'), not precision={precision!r}; the model is left unchanged.",
        stacklevel=3,
    )


class LPLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that runs in the autocast dtype while autocast is active (see the module docstring)."""

    @classmethod
    def from_layernorm(cls, layernorm: nn.LayerNorm) -> LPLayerNorm:
        """The low-precision version of ``layernorm``, sharing its parameters."""
        low = cls(
            layernorm.normalized_shape,
            eps=layernorm.eps,
            elementwise_affine=layernorm.elementwise_affine,
            bias=layernorm.bias is not None,
            device="meta",
        )
        return share_tensors(layernorm, low)

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(input)
        if dtype is None:
            return super().forward(input)
        with torch.autocast(input.device.type, enabled=False):
            return F.layer_norm(
                input.to(dtype),
                self.normalized_shape,
                cast_to(self.weight, dtype),
                cast_to(self.bias, dtype),
                self.eps,
            )


def apply_low_precision_layernorm(
    model: nn.Module, precision: str, optimizers: Sequence[Optimizer] = ()
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace ``model``'s ``nn.LayerNorm`` modules by :class:`LPLayerNorm`, in place; returns what was replaced.

    With a ``precision`` that is not mixed, warns and changes nothing (see the module docstring). The
    replacements share the original parameters, so ``optimizers`` need no change.
    """
    if not is_mixed_precision(precision):
        warn_no_effect("LowPrecisionLayerNorm", precision)
        return {}
    return _replace_layernorms(model, optimizers)


def _replace_layernorms(model: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, tuple[nn.Module, nn.Module]]:
    return replace_norms(model, nn.LayerNorm, LPLayerNorm.from_layernorm, optimizers)


NormT = TypeVar("NormT", bound=nn.Module)


def replace_norms(
    model: nn.Module,
    norm_type: type[NormT],
    low_precision: Callable[[NormT], nn.Module],
    optimizers: Sequence[Optimizer],
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace every ``norm_type`` module of ``model`` by ``low_precision(module)``, in place."""

    def replacement(module: nn.Module, name: str) -> nn.Module:
        assert isinstance(module, norm_type)
        return low_precision(module)

    return replace_modules(model, {norm_type: replacement}, optimizers)


class LowPrecisionNorm(SurgeryAlgorithm):
    """A normalisation layer in the autocast dtype, set up at INIT for mixed precision (see the module docstring):
    the shared behaviour of :class:`LowPrecisionLayerNorm` and ``LowPrecisionGroupNorm``."""

    #: The state dict keeps its keys and shapes: a checkpoint loads into an unmodified model.
    changes_module_structure = False
    #: The normalisation class this algorithm replaces.
    norm_type: ClassVar[type[nn.Module]]

    def replace(self, model: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, tuple[nn.Module, nn.Module]]:
        """Replace ``model``'s :attr:`norm_type` modules, in place; returns what was replaced."""
        raise NotImplementedError

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        precision = run_precision(state)
        if not is_mixed_precision(precision):
            warn_no_effect(type(self).__name__, precision)
            return
        super().apply(event, state, logger)

    @override
    def apply_surgery(self, model: nn.Module, optimizers: Sequence[Optimizer] = ()) -> None:
        if not self.replace(model, optimizers):
            name, norm = type(self).__name__, self.norm_type.__name__
            warnings.warn(f"{name} found no nn.{norm} in {type(model).__name__}.", stacklevel=2)

    @override
    def hparams(self) -> dict[str, Any]:
        return {}


class LowPrecisionLayerNorm(LowPrecisionNorm):
    """LayerNorm in the autocast dtype, set up at INIT for mixed precision (see the module docstring)."""

    norm_type = nn.LayerNorm

    @override
    def replace(self, model: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, tuple[nn.Module, nn.Module]]:
        return _replace_layernorms(model, optimizers)
