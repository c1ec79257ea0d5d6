"""Precision under DeepSpeed: the engine casts the model and scales the loss, Fabric only casts inputs.

DeepSpeed's ``fp16``/``bf16`` modes keep half-precision parameters with float32 master weights in the
optimizer, which is what ``16-mixed``/``bf16-mixed`` mean to a Fabric user. No autocast and no
GradScaler run on top of it: DeepSpeed's engine owns the loss scale and saves it in its checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from fabric.plugins.precision.dtypes import PRECISION_DTYPES
from fabric.plugins.precision.precision import Precision
from fabric.strategies.deepspeed.config import PRECISION_SECTIONS
from fabric.utilities.apply_func import convert_floating_tensors


class DeepSpeedPrecision(Precision):
    """Casts floating-point inputs to the engine's dtype and outputs back to float32."""

    def __init__(self, precision: str, *, device_type: str = "cpu") -> None:
        super().__init__(device_type=device_type)
        if precision not in PRECISION_SECTIONS:
            raise ValueError(
                f"precision={precision!r} is not supported with DeepSpeed. Accepted values: {list(PRECISION_SECTIONS)}."
            )
        self.name = precision
        self.dtype = PRECISION_DTYPES[precision]

    @property
    @override
    def forward_is_identity(self) -> bool:  # type: ignore[override]
        return self.dtype == torch.float32

    @override
    def convert_input(self, data: Any) -> Any:
        return convert_floating_tensors(data, self.dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        return convert_floating_tensors(data, torch.get_default_dtype(), src=(self.dtype,))
