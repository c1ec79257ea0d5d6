"""``ACCELERATOR_REGISTRY``: accelerator names to classes, named lazily so the registry costs no torch import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.registry import Registry

if TYPE_CHECKING:
    from fabric.accelerators.accelerator import Accelerator

#: Registration order is the order ``accelerator="auto"`` tries them in.
ACCELERATOR_REGISTRY: Registry[Accelerator] = Registry("accelerator")
ACCELERATOR_REGISTRY.register(
    "cuda", "fabric.accelerators.cuda:CUDAAccelerator", description="NVIDIA/AMD GPUs through CUDA/ROCm"
)
ACCELERATOR_REGISTRY.register("mps", "fabric.accelerators.mps:MPSAccelerator", description="Apple silicon GPU")
ACCELERATOR_REGISTRY.register(
    "cpu", "fabric.accelerators.cpu:CPUAccelerator", description="the CPU; devices count processes"
)

#: Accelerator names the connector resolves itself, on top of the registered ones.
SPECIAL_ACCELERATORS = ("auto", "gpu")

#: What ``accelerator="gpu"`` means: the first available of these.
GPU_ACCELERATORS = ("cuda", "mps")


def accelerator_choices() -> list[str]:
    """Every accelerator string a user may type."""
    return [*SPECIAL_ACCELERATORS, *ACCELERATOR_REGISTRY.choices()]
