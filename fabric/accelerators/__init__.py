"""Accelerators: which device type a process runs on. Classes load on first use; the registry is light."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.accelerators.registry import ACCELERATOR_REGISTRY
from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.accelerators.accelerator import Accelerator
    from fabric.accelerators.cpu import CPUAccelerator
    from fabric.accelerators.cuda import CUDAAccelerator
    from fabric.accelerators.mps import MPSAccelerator

__all__ = ["ACCELERATOR_REGISTRY", "Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator"]
__getattr__ = lazy_exports(
    __name__,
    {
        "Accelerator": "fabric.accelerators.accelerator",
        "CPUAccelerator": "fabric.accelerators.cpu",
        "CUDAAccelerator": "fabric.accelerators.cuda",
        "MPSAccelerator": "fabric.accelerators.mps",
    },
)
