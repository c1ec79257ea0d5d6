"""``SystemMetricsMonitor``: the machine's CPU, memory, disk and network use, and the GPUs' load, after each batch."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from fabric.trainer.callbacks._utils import training_device, world_size
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import require_fabric

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State

#: Per-GPU metrics (Composer's names) and how to read them from ``torch.cuda`` (through NVML).
GPU_METRICS = ("gpu_percentage", "memory_percentage", "gpu_temperature_C", "gpu_power_usage_W")


class SystemMetricsMonitor(Callback):
    """Logs system metrics at every ``BATCH_END``, under Composer's names.

    For the node of the logging process (from ``psutil``): ``cpu_percentage`` (since the previous batch),
    ``cpu_memory_<field>`` for each field of ``psutil.virtual_memory()`` (``total``, ``available``, ``used``,
    ``percent``, ...; bytes), ``disk_memory_<field>`` of ``psutil.disk_usage('/')`` and ``network_<field>``
    of ``psutil.net_io_counters()`` (``bytes_sent``, ``bytes_recv``, ...; totals since boot).

    When training on CUDA, per GPU (through NVML, as ``torch.cuda.utilization`` reads it):
    ``gpu_percentage`` (time a kernel ran), ``memory_percentage`` (time memory was read or written),
    ``gpu_temperature_C`` and ``gpu_power_usage_W``, gathered from every rank (a collective: every rank must
    run this callback). Logged as ``min_<metric>_rank_<r>`` and ``max_<metric>_rank_<r>`` (the ranks with the
    lowest and highest values) or, with ``log_all_data``, as ``<metric>_rank_<r>`` for every rank.

    Needs ``psutil`` (``pip install psutil``) and, on CUDA, NVML's bindings (``pip install nvidia-ml-py``).
    """

    def __init__(self, log_all_data: bool = False) -> None:
        if not isinstance(log_all_data, bool):
            raise ValueError(f"log_all_data must be True or False; got {log_all_data!r}.")
        try:
            psutil = _psutil()
        except ImportError:
            raise ModuleNotFoundError(
                "SystemMetricsMonitor reads the system's metrics with psutil, which is not installed: "
                "pip install psutil"
            ) from None
        self.log_all_data = log_all_data
        self._gpu: torch.device | None = None
        self._checked = False  # whether the device was looked at
        psutil.cpu_percent(interval=None)  # starts the count that the first batch's reading ends

    @override
    def init(self, state: State, logger: Logger) -> None:
        self._check_device(state)

    def _check_device(self, state: State) -> None:
        """On CUDA, read the GPU once now, so missing NVML bindings fail when the Trainer is built."""
        if self._checked:
            return
        self._checked = True
        device = training_device(state)
        if device.type != "cuda":
            return
        try:
            torch.cuda.utilization(device)
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                f"SystemMetricsMonitor reads the GPUs' load through NVML, whose Python bindings are missing "
                f"({error}): pip install nvidia-ml-py"
            ) from None
        self._gpu = device

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        self._check_device(state)
        metrics = self._node_metrics()
        if self._gpu is not None:
            metrics.update(self._gpu_metrics(state, self._gpu))
        logger.log_metrics(metrics)

    def _node_metrics(self) -> dict[str, float]:
        psutil = _psutil()
        metrics = {"cpu_percentage": float(psutil.cpu_percent(interval=None))}
        readings = (
            ("cpu_memory", psutil.virtual_memory()),
            ("disk_memory", psutil.disk_usage(os.sep)),
            ("network", psutil.net_io_counters()),  # None where the machine has no network interface
        )
        for prefix, reading in readings:
            if reading is not None:
                metrics.update({f"{prefix}_{field}": float(value) for field, value in reading._asdict().items()})
        return metrics

    def _gpu_metrics(self, state: State, device: torch.device) -> dict[str, float]:
        values = torch.tensor(
            [
                float(torch.cuda.utilization(device)),
                float(torch.cuda.memory_usage(device)),
                float(torch.cuda.temperature(device)),
                torch.cuda.power_draw(device) / 1000.0,  # milliwatts
            ],
            dtype=torch.float64,
        )
        # One row per rank; all ranks reach every BATCH_END, so the gather cannot hang.
        per_rank = require_fabric(state).all_gather(values).cpu() if world_size(state) > 1 else values.unsqueeze(0)
        metrics = {}
        for column, name in enumerate(GPU_METRICS):
            ranks = per_rank[:, column]
            if self.log_all_data:
                metrics.update({f"{name}_rank_{rank}": value for rank, value in enumerate(ranks.tolist())})
            else:
                low, high = int(ranks.argmin()), int(ranks.argmax())
                metrics[f"min_{name}_rank_{low}"] = float(ranks[low])
                metrics[f"max_{name}_rank_{high}"] = float(ranks[high])
        return metrics


def _psutil() -> Any:
    """The ``psutil`` module (an optional dependency, so imported on use)."""
    return importlib.import_module("psutil")
