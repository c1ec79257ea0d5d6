"""Strategies: how the work is spread over devices and processes. Classes load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.strategies.registry import STRATEGY_REGISTRY
from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.strategies.ddp import DDPStrategy
    from fabric.strategies.deepspeed.strategy import DeepSpeedStrategy
    from fabric.strategies.fault_tolerant.fsdp import FaultTolerantFSDPStrategy
    from fabric.strategies.fault_tolerant.strategy import FaultTolerantDDPStrategy
    from fabric.strategies.fsdp.strategy import FSDPStrategy
    from fabric.strategies.mesh import MeshPlan
    from fabric.strategies.model_parallel import ModelParallelStrategy
    from fabric.strategies.parallel import ParallelStrategy
    from fabric.strategies.pipeline import PipelinePlan
    from fabric.strategies.single_device import SingleDeviceStrategy
    from fabric.strategies.strategy import Strategy

__all__ = [
    "STRATEGY_REGISTRY",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "FaultTolerantDDPStrategy",
    "FaultTolerantFSDPStrategy",
    "MeshPlan",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "PipelinePlan",
    "SingleDeviceStrategy",
    "Strategy",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "DDPStrategy": "fabric.strategies.ddp",
        "DeepSpeedStrategy": "fabric.strategies.deepspeed.strategy",
        "FSDPStrategy": "fabric.strategies.fsdp.strategy",
        "FaultTolerantDDPStrategy": "fabric.strategies.fault_tolerant.strategy",
        "FaultTolerantFSDPStrategy": "fabric.strategies.fault_tolerant.fsdp",
        "MeshPlan": "fabric.strategies.mesh",
        "ModelParallelStrategy": "fabric.strategies.model_parallel",
        "ParallelStrategy": "fabric.strategies.parallel",
        "PipelinePlan": "fabric.strategies.pipeline",
        "SingleDeviceStrategy": "fabric.strategies.single_device",
        "Strategy": "fabric.strategies.strategy",
    },
)
