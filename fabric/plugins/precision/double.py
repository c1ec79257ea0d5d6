"""``"64-true"``: parameters, inputs, compute and outputs all in float64."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from fabric.plugins.precision.precision import Precision, default_dtype
from fabric.utilities.apply_func import convert_floating_tensors


class DoublePrecision(Precision):
    name = "64-true"
    forward_is_identity = False

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.double()

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return default_dtype(torch.float64)

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        return default_dtype(torch.float64)

    @override
    def convert_input(self, data: Any) -> Any:
        return convert_floating_tensors(data, torch.float64)
