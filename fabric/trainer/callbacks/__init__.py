"""The Trainer's built-in callbacks: throughput, learning rates, norms, early stopping, NaN checks, ETA, memory.

Names load on first use, so ``import fabric.trainer.callbacks`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.callbacks.early_stopper import EarlyStopper
    from fabric.trainer.callbacks.lr_monitor import LRMonitor
    from fabric.trainer.callbacks.memory_monitor import MemoryMonitor
    from fabric.trainer.callbacks.nan_monitor import NaNMonitor
    from fabric.trainer.callbacks.optimizer_monitor import OptimizerMonitor
    from fabric.trainer.callbacks.runtime_estimator import RuntimeEstimator
    from fabric.trainer.callbacks.speed_monitor import SpeedMonitor
    from fabric.trainer.callbacks.threshold_stopper import ThresholdStopper

__all__ = [
    "EarlyStopper",
    "LRMonitor",
    "MemoryMonitor",
    "NaNMonitor",
    "OptimizerMonitor",
    "RuntimeEstimator",
    "SpeedMonitor",
    "ThresholdStopper",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "EarlyStopper": "fabric.trainer.callbacks.early_stopper",
        "LRMonitor": "fabric.trainer.callbacks.lr_monitor",
        "MemoryMonitor": "fabric.trainer.callbacks.memory_monitor",
        "NaNMonitor": "fabric.trainer.callbacks.nan_monitor",
        "OptimizerMonitor": "fabric.trainer.callbacks.optimizer_monitor",
        "RuntimeEstimator": "fabric.trainer.callbacks.runtime_estimator",
        "SpeedMonitor": "fabric.trainer.callbacks.speed_monitor",
        "ThresholdStopper": "fabric.trainer.callbacks.threshold_stopper",
    },
)
