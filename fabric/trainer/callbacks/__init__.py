"""The Trainer's built-in callbacks: throughput, learning rates, norms, early stopping, NaN checks, ETA, memory,
system metrics, activations, out-of-memory snapshots, export for inference, Hugging Face folders and generations.

Names load on first use, so ``import fabric.trainer.callbacks`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.trainer.callbacks.activation_monitor import ActivationMonitor
    from fabric.trainer.callbacks.early_stopper import EarlyStopper
    from fabric.trainer.callbacks.export_for_inference import ExportForInference, ExportForInferenceCallback
    from fabric.trainer.callbacks.generate import Generate
    from fabric.trainer.callbacks.huggingface_checkpointer import HuggingFaceCheckpointer
    from fabric.trainer.callbacks.lr_monitor import LRMonitor
    from fabric.trainer.callbacks.memory_monitor import MemoryMonitor
    from fabric.trainer.callbacks.memory_snapshot import MemorySnapshot
    from fabric.trainer.callbacks.nan_monitor import NaNMonitor
    from fabric.trainer.callbacks.oom_observer import OOMObserver
    from fabric.trainer.callbacks.optimizer_monitor import OptimizerMonitor
    from fabric.trainer.callbacks.runtime_estimator import RuntimeEstimator
    from fabric.trainer.callbacks.speed_monitor import SpeedMonitor
    from fabric.trainer.callbacks.system_metrics_monitor import SystemMetricsMonitor
    from fabric.trainer.callbacks.threshold_stopper import ThresholdStopper

__all__ = [
    "ActivationMonitor",
    "EarlyStopper",
    "ExportForInference",
    "ExportForInferenceCallback",
    "Generate",
    "HuggingFaceCheckpointer",
    "LRMonitor",
    "MemoryMonitor",
    "MemorySnapshot",
    "NaNMonitor",
    "OOMObserver",
    "OptimizerMonitor",
    "RuntimeEstimator",
    "SpeedMonitor",
    "SystemMetricsMonitor",
    "ThresholdStopper",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "ActivationMonitor": "fabric.trainer.callbacks.activation_monitor",
        "EarlyStopper": "fabric.trainer.callbacks.early_stopper",
        "ExportForInference": "fabric.trainer.callbacks.export_for_inference",
        "ExportForInferenceCallback": "fabric.trainer.callbacks.export_for_inference",
        "Generate": "fabric.trainer.callbacks.generate",
        "HuggingFaceCheckpointer": "fabric.trainer.callbacks.huggingface_checkpointer",
        "LRMonitor": "fabric.trainer.callbacks.lr_monitor",
        "MemoryMonitor": "fabric.trainer.callbacks.memory_monitor",
        "MemorySnapshot": "fabric.trainer.callbacks.memory_snapshot",
        "NaNMonitor": "fabric.trainer.callbacks.nan_monitor",
        "OOMObserver": "fabric.trainer.callbacks.oom_observer",
        "OptimizerMonitor": "fabric.trainer.callbacks.optimizer_monitor",
        "RuntimeEstimator": "fabric.trainer.callbacks.runtime_estimator",
        "SpeedMonitor": "fabric.trainer.callbacks.speed_monitor",
        "SystemMetricsMonitor": "fabric.trainer.callbacks.system_metrics_monitor",
        "ThresholdStopper": "fabric.trainer.callbacks.threshold_stopper",
    },
)
