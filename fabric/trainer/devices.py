"""Composer's ``Device`` objects: the hardware a Composer program names (``get_device(None)``), for programs that
pass one around (llm-foundry's ``initialize_dist(get_device(None))``).

The Trainer itself takes the device by name (``Trainer(device="cpu" | "gpu" | "mps")``) and moves data through
Fabric; a :class:`Device` says which name, which torch device and which ``torch.distributed`` backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch

from fabric.utilities.apply_func import move_data_to_device

__all__ = ["Device", "DeviceCPU", "DeviceGPU", "DeviceMPS", "get_device"]

M = TypeVar("M", bound=torch.nn.Module)


class Device:
    """One device of this process: ``name`` is Composer's, ``dist_backend`` the collectives' backend for it."""

    name: ClassVar[str]
    dist_backend: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def tensor_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._device)

    def module_to_device(self, module: M) -> M:
        return module.to(self._device)

    def batch_to_device(self, batch: Any) -> Any:
        """Every tensor in ``batch`` (nested collections too) on this device."""
        return move_data_to_device(batch, self._device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._device})"


class DeviceCPU(Device):
    name, dist_backend = "cpu", "gloo"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))


class DeviceGPU(Device):
    """The GPU of this local rank (``LOCAL_RANK``), or ``device_id``."""

    name, dist_backend = "gpu", "nccl"

    def __init__(self, device_id: int | None = None) -> None:
        if device_id is None:
            device_id = int(os.environ.get("LOCAL_RANK", "0"))
        super().__init__(torch.device("cuda", device_id))


class DeviceMPS(Device):
    name, dist_backend = "mps", "gloo"

    def __init__(self) -> None:
        super().__init__(torch.device("mps"))


DEVICES: dict[str, Callable[[], Device]] = {"cpu": DeviceCPU, "gpu": DeviceGPU, "mps": DeviceMPS}


def get_device(device: str | Device | None = None) -> Device:
    """``device`` as a :class:`Device`; ``None`` picks as Composer does: a GPU when CUDA is available, else the CPU."""
    if isinstance(device, Device):
        return device
    if device is None:
        return DeviceGPU() if torch.cuda.is_available() else DeviceCPU()
    if device not in DEVICES:
        raise ValueError(f"get_device({device!r}): the device is one of {sorted(DEVICES)}, a Device, or None.")
    return DEVICES[device]()
