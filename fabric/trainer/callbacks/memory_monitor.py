"""``MemoryMonitor``: memory in use after each batch (CUDA's allocator stats, or the process's RSS), to see how
close a run is to running out."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from fabric.trainer.callbacks._utils import check_count, training_device, world_size
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.state import require_fabric

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State
    from fabric.utilities.distributed import ReduceOp

#: Composer's default ``torch.cuda.memory_stats`` keys and the names they are logged under (after ``memory/``).
CUDA_MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "current_allocated_mem",
    "active_bytes.all.current": "current_active_mem",
    "inactive_split_bytes.all.current": "current_inactive_mem",
    "reserved_bytes.all.current": "current_reserved_mem",
    "allocated_bytes.all.peak": "peak_allocated_mem",
    "active_bytes.all.peak": "peak_active_mem",
    "inactive_split_bytes.all.peak": "peak_inactive_mem",
    "reserved_bytes.all.peak": "peak_reserved_mem",
    "num_alloc_retries": "alloc_retries",
}
_BYTES_PER_GB = 1e9


class MemoryMonitor(Callback):
    """Logs memory use under ``memory/<name>`` at ``AFTER_TRAIN_BATCH``, when the gradients are still held.

    On CUDA: Composer's names and ``torch.cuda.memory_stats`` keys (:data:`CUDA_MEMORY_KEYS`):
    ``memory/current_allocated_mem``, ``current_active_mem``, ``current_inactive_mem``, ``current_reserved_mem``,
    their ``peak_*`` twins (since the process started or ``torch.cuda.reset_peak_memory_stats``) and
    ``alloc_retries`` (cudaMalloc retries, a sign of fragmentation). Byte counts are in GB (10^9 bytes).
    ``memory_keys`` replaces that table (``{"allocated_bytes.all.current": "my_name"}``).

    On other devices: the process's resident memory, ``memory/current_rss_mem`` (from ``psutil`` if installed,
    else ``/proc/self/statm``) and ``memory/peak_rss_mem`` (``getrusage``), in GB; ``memory_keys`` does not apply.

    With ``dist_aggregate_batch_interval=N`` and several processes, every N batches each value is also logged
    as ``<name>_avg``, ``<name>_min`` and ``<name>_max`` over the ranks (a collective: every rank must run
    this callback). Values are logged at the step of the batch being trained, next to its loss.
    """

    def __init__(
        self, memory_keys: Mapping[str, str] | None = None, dist_aggregate_batch_interval: int | None = None
    ) -> None:
        if memory_keys is not None and (
            not isinstance(memory_keys, Mapping)
            or not memory_keys
            or not all(isinstance(key, str) and isinstance(name, str) and name for key, name in memory_keys.items())
        ):
            raise ValueError(
                "memory_keys must map torch.cuda.memory_stats() keys to the names to log them under, e.g. "
                f"{{'allocated_bytes.all.current': 'current_allocated_mem'}}, or be None; got {memory_keys!r}."
            )
        if dist_aggregate_batch_interval is not None:
            check_count(dist_aggregate_batch_interval, "dist_aggregate_batch_interval", 1)
        self.memory_keys = dict(memory_keys) if memory_keys is not None else None
        self.dist_aggregate_batch_interval = dist_aggregate_batch_interval

    @override
    def after_train_batch(self, state: State, logger: Logger) -> None:
        device = training_device(state)
        if device.type == "cuda":
            report = cuda_memory_report(device, self.memory_keys or CUDA_MEMORY_KEYS)
        else:
            report = host_memory_report()
        interval = self.dist_aggregate_batch_interval
        # The clock is global, so every rank takes part in the same batches' collectives.
        if interval is not None and world_size(state) > 1 and int(state.timestamp.batch) % interval == 0:
            report.update(_aggregated(state, report))
        metrics = {f"memory/{name}": value for name, value in report.items()}
        logger.log_metrics(metrics, step=_batch_being_trained(state))


def cuda_memory_report(device: torch.device, memory_keys: Mapping[str, str]) -> dict[str, float]:
    """The named ``torch.cuda.memory_stats`` values of ``device``; byte counts in GB."""
    stats = torch.cuda.memory_stats(device)
    return {
        name: stats[key] / _BYTES_PER_GB if "bytes" in key else float(stats[key])
        for key, name in memory_keys.items()
        if key in stats
    }


def host_memory_report() -> dict[str, float]:
    """This process's resident memory now and at its peak, in GB, as far as this platform tells."""
    report = {}
    current = _current_rss_bytes()
    if current is not None:
        report["current_rss_mem"] = current / _BYTES_PER_GB
    peak = _peak_rss_bytes()
    if peak is not None:  # the kernel updates its high-water mark lazily: it may lag the current value
        report["peak_rss_mem"] = max(peak, current or 0) / _BYTES_PER_GB
    return report


def _current_rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        pass
    else:
        rss: int = psutil.Process().memory_info().rss
        return rss
    try:
        with open("/proc/self/statm") as statm:  # size resident shared ... (in pages)
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _aggregated(state: State, report: dict[str, float]) -> dict[str, float]:
    """Each value's mean, min and max over the ranks: three all-reduces of one vector."""
    names = list(report)
    values = torch.tensor([report[name] for name in names], dtype=torch.float64)
    aggregated = {}
    reductions: tuple[tuple[str, ReduceOp], ...] = (("avg", "mean"), ("min", "min"), ("max", "max"))
    for suffix, op in reductions:
        reduced = require_fabric(state).all_reduce(values, reduce_op=op).tolist()
        aggregated.update({f"{name}_{suffix}": value for name, value in zip(names, reduced, strict=True)})
    return aggregated


def _batch_being_trained(state: State) -> int:
    """The step of the batch in flight at ``AFTER_TRAIN_BATCH`` (the clock advances after it)."""
    return int(state.timestamp.batch) + 1
