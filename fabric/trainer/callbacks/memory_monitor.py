"""``MemoryMonitor``: CUDA memory in use after each batch, to see how close a run is to running out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fabric.trainer.callback import Callback

if TYPE_CHECKING:
    from fabric.trainer.state import State

#: ``torch.cuda.memory_stats`` keys and the names they are logged under.
_LOGGED_STATS = {
    "allocated_bytes.all.current": "memory/allocated_mem",
    "allocated_bytes.all.peak": "memory/peak_allocated_mem",
    "reserved_bytes.all.current": "memory/reserved_mem",
}
_BYTES_PER_GB = 1e9


class MemoryMonitor(Callback):
    """Logs ``memory/allocated_mem``, ``memory/peak_allocated_mem`` and ``memory/reserved_mem`` in GB (10^9 bytes).

    Read at ``AFTER_TRAIN_BATCH``, when the gradients are still held. The peak is since the start of the
    process (or the last ``torch.cuda.reset_peak_memory_stats``). On other devices it logs nothing.
    """

    def after_train_batch(self, state: State, logger: Any) -> None:
        device = _device(state)
        if device.type != "cuda":
            return
        stats = torch.cuda.memory_stats(device)
        values = {name: stats[key] / _BYTES_PER_GB for key, name in _LOGGED_STATS.items() if key in stats}
        logger.log_metrics(values, step=int(state.timestamp.batch) + 1)  # the batch being trained


def _device(state: State) -> torch.device:
    """The device training runs on: Fabric's, or else where the model's first parameter lives."""
    if state.fabric is not None:
        device: torch.device = state.fabric.device
        return device
    parameter = next(state.model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device
