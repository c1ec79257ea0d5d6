"""The CUDA accelerator (NVIDIA and ROCm GPUs)."""

from __future__ import annotations

import torch
from typing_extensions import override

from fabric.accelerators.accelerator import Accelerator


class CUDAAccelerator(Accelerator):
    device_type = "cuda"

    @staticmethod
    @override
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    @override
    def device_count() -> int:
        return torch.cuda.device_count()

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDAAccelerator cannot set up device {device}; expected a 'cuda' device.")
        torch.cuda.set_device(device)

    @override
    def teardown(self) -> None:
        torch.cuda.empty_cache()

    @override
    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16:
            return bool(torch.cuda.is_bf16_supported())
        return True
