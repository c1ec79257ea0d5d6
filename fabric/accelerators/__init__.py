"""Accelerators: which device type a process runs on. ``ACCELERATOR_REGISTRY`` maps names to classes."""

from fabric.accelerators.accelerator import Accelerator
from fabric.accelerators.cpu import CPUAccelerator
from fabric.accelerators.cuda import CUDAAccelerator
from fabric.accelerators.mps import MPSAccelerator
from fabric.utilities.registry import Registry

#: Registration order is the order ``accelerator="auto"`` tries them in.
ACCELERATOR_REGISTRY: Registry[Accelerator] = Registry("accelerator")
ACCELERATOR_REGISTRY.register("cuda", CUDAAccelerator, description="NVIDIA/AMD GPUs through CUDA/ROCm")
ACCELERATOR_REGISTRY.register("mps", MPSAccelerator, description="Apple silicon GPU")
ACCELERATOR_REGISTRY.register("cpu", CPUAccelerator, description="the CPU; devices count processes")

__all__ = ["ACCELERATOR_REGISTRY", "Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator"]
