"""The CPU accelerator: ``devices`` counts processes, since every process shares the same CPU device."""

from __future__ import annotations

import os

import torch
from typing_extensions import override

from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.device_parser import ALL, AUTO, DeviceRequest
from fabric.utilities.rank_zero import rank_zero_warn

#: More CPU processes than this many per core is almost surely a mistake (e.g. devices=100000): warn.
OVERSUBSCRIPTION_WARNING_FACTOR = 4


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
        cores = self.device_count()
        if count > OVERSUBSCRIPTION_WARNING_FACTOR * cores:
            rank_zero_warn(
                f"devices={count} starts {count} CPU processes on this node, which has {cores} cores "
                f"({count / cores:.0f} per core): each gets a sliver of a core and its own copy of the model, and "
                f"the job may exhaust memory or take ages to start. Did you mean devices={cores} (or devices=-1)?"
            )
        return [torch.device("cpu")] * count
