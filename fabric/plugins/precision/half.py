"""``"16-true"`` / ``"bf16-true"``: parameters and compute in half precision, no float32 master copy.

Halves parameter memory. Inputs are cast to the half dtype; outputs come back as float32 (the
default dtype) so losses and metrics computed outside the module are accumulated accurately.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal, get_args

import torch
from torch import nn
from typing_extensions import override

from fabric.plugins.precision.dtypes import PRECISION_DTYPES
from fabric.plugins.precision.precision import Precision, default_dtype
from fabric.utilities.apply_func import convert_floating_tensors

HalfName = Literal["16-true", "bf16-true"]


class ComputeDtypePrecision(Precision):
    """Tensors made, inputs and compute in ``self.dtype`` (set by the subclass); outputs back in the default dtype.
    The half precisions and the quantized one (``BitsandbytesPrecision``) share this."""

    forward_is_identity = False
    dtype: torch.dtype

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return default_dtype(self.dtype)

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        return default_dtype(self.dtype)

    @override
    def convert_input(self, data: Any) -> Any:
        return convert_floating_tensors(data, self.dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        return convert_floating_tensors(data, torch.get_default_dtype(), src=(self.dtype,))


class HalfPrecision(ComputeDtypePrecision):
    def __init__(self, precision: HalfName = "bf16-true", *, device_type: str = "cpu") -> None:
        super().__init__(device_type=device_type)
        if precision not in get_args(HalfName):
            raise ValueError(f"HalfPrecision(precision={precision!r}): accepted values are {list(get_args(HalfName))}.")
        self.name = precision
        self.dtype = PRECISION_DTYPES[precision]

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.dtype)
