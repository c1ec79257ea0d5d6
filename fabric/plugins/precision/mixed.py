"""``"16-mixed"`` / ``"bf16-mixed"``: float32 parameters, forward under ``torch.autocast``.

``16-mixed`` also scales the loss with a :class:`torch.amp.GradScaler` on every device type (float16
activation gradients underflow on CPU just as on CUDA); ``bf16-mixed`` has float32's range and needs
no scaling. Outputs that autocast produced in half precision are returned as float32.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.plugins.precision.dtypes import PRECISION_DTYPES
from fabric.plugins.precision.precision import Precision
from fabric.utilities.apply_func import convert_floating_tensors

MixedName = Literal["16-mixed", "bf16-mixed"]
#: What autocast computes in, and outputs are cast back from.
HALF_DTYPES = (torch.float16, torch.bfloat16)


class MixedPrecision(Precision):
    forward_is_identity = False

    def __init__(
        self,
        precision: MixedName = "bf16-mixed",
        *,
        device_type: str = "cpu",
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(device_type=device_type)
        if precision not in get_args(MixedName):
            raise ValueError(
                f"MixedPrecision(precision={precision!r}): accepted values are {list(get_args(MixedName))}."
            )
        if scaler is not None and precision == "bf16-mixed":
            raise ValueError("A GradScaler is only used with precision='16-mixed'; bf16 needs no loss scaling.")
        self.name = precision
        self.dtype = PRECISION_DTYPES[precision]
        if scaler is None and precision == "16-mixed":
            scaler = torch.amp.GradScaler(device_type)
        self.scaler = scaler
        # Without a scaler the backward and the step are the plain ones: Fabric calls them directly, per step.
        self.backward_is_plain = self.optimizer_step_is_plain = scaler is None

    @property
    @override
    def requires_fabric_backward(self) -> bool:  # type: ignore[override]
        return self.scaler is not None

    @property
    @override
    def skips_non_finite_steps(self) -> bool:  # type: ignore[override]
        return self.scaler is not None

    @property
    @override
    def scales_gradients(self) -> bool:  # type: ignore[override]
        return self.scaler is not None

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        if type(data) is torch.Tensor:  # the common output, without walking a collection (per forward)
            if data.dtype not in HALF_DTYPES:
                return data
            default = torch.get_default_dtype()
            return data.float() if default is torch.float32 else data.to(default)
        return convert_floating_tensors(data, torch.get_default_dtype(), src=HALF_DTYPES)

    @override
    def pre_backward(self, tensor: torch.Tensor, module: nn.Module | None) -> torch.Tensor:
        return tensor if self.scaler is None else self.scaler.scale(tensor)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, closure)
        if closure is not None:
            raise ValueError(
                "precision='16-mixed' steps through a GradScaler, which does not support optimizer closures. "
                "Use precision='bf16-mixed', or call the closure yourself before optimizer.step()."
            )
        # The scaler unscales (unless clip_gradients already did), skips the step on inf/NaN gradients,
        # and adapts the scale for the next iteration.
        output = self.scaler.step(optimizer)
        self.scaler.update()
        return output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
