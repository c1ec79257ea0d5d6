"""The CPU accelerator: ``devices`` counts processes, since every process shares the same CPU device."""

from __future__ import annotations

import os

import torch
from typing_extensions import override

from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.device_parser import ALL, AUTO, DeviceRequest, cpu_oversubscription
from fabric.utilities.rank_zero import rank_zero_warn


class CPUAccelerator(Accelerator):
    device_type = "cpu"

    @staticmethod
    @override
    def is_available() -> bool:
        return True

    @staticmethod
    @override
    def device_count() -> int:
        return os.cpu_count() or 1

    @classmethod
    @override
    def auto_device_count(cls) -> int:
        """One: ``devices="auto"`` on the CPU is one process, as in Lightning."""
        return 1

    @override
    def resolve_devices(self, request: DeviceRequest) -> list[torch.device]:
        """``auto`` is one process, ``-1`` one per core, ``N`` is N processes; indices make no sense here."""
        if isinstance(request, tuple):
            raise ValueError(
                f"devices={list(request)!r} lists device indices, but CPU processes all share one CPU device. "
                "Pass how many processes to run instead, e.g. devices=2."
            )
        if request == AUTO:
            return [torch.device("cpu")]
        count = self.device_count() if request == ALL else request
        warning = cpu_oversubscription(count, self.device_count(), "devices")
        if warning is not None:
            rank_zero_warn(warning)
        return [torch.device("cpu")] * count
