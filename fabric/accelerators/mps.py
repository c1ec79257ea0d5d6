"""The Apple-silicon MPS accelerator: a single device, no float64."""

from __future__ import annotations

import torch
from typing_extensions import override

from fabric.accelerators.accelerator import Accelerator


class MPSAccelerator(Accelerator):
    device_type = "mps"

    @staticmethod
    @override
    def is_available() -> bool:
        return torch.backends.mps.is_available()

    @staticmethod
    @override
    def device_count() -> int:
        return 1 if torch.backends.mps.is_available() else 0

    @override
    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype != torch.float64
