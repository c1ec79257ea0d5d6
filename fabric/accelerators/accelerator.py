"""The accelerator interface: what kind of device a process runs on and how many exist."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from fabric.utilities.device_parser import ALL, AUTO, DeviceRequest


class Accelerator(ABC):
    """Knows one device type: whether it is present, how many there are, and how to claim one."""

    #: The ``torch.device`` type this accelerator drives (``"cpu"``, ``"cuda"``, ``"mps"``).
    device_type: ClassVar[str]

    @staticmethod
    @abstractmethod
    def is_available() -> bool:
        """Whether this machine has at least one such device."""

    @staticmethod
    @abstractmethod
    def device_count() -> int:
        """How many devices of this type the process can see."""

    @classmethod
    def auto_device_count(cls) -> int:
        """Lightning's name for :meth:`device_count`, which programs written for it call (litgpt's tensor-parallel
        and sequential generation count the devices with it)."""
        return cls.device_count()

    def setup_device(self, device: torch.device) -> None:  # noqa: B027 - optional hook
        """Make ``device`` the current one for this process (a no-op where there is no such notion)."""

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Release what :meth:`setup_device` claimed."""

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether parameters and compute in ``dtype`` work on this device."""
        return True

    def resolve_devices(self, request: DeviceRequest) -> list[torch.device]:
        """Turn a parsed ``devices`` request into the list of local devices, one per process."""
        available = self.device_count()
        if request in (AUTO, ALL):
            indices: tuple[int, ...] = tuple(range(available))
        elif isinstance(request, int):
            indices = tuple(range(request))
        else:
            indices = request
        missing = [index for index in indices if index >= available]
        if not indices or missing:
            raise ValueError(
                f"devices={_describe(request)} asks for {self.device_type.upper()} device(s) {list(indices)}, "
                f"but this machine has {available} (indices 0..{available - 1})."
            )
        return [torch.device(self.device_type, index) for index in indices]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _describe(request: DeviceRequest) -> str:
    return repr(list(request)) if isinstance(request, tuple) else repr(request)
