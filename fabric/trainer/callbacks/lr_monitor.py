"""``LRMonitor``: log every optimizer parameter group's learning rate after each batch."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from torch.optim import Optimizer
from typing_extensions import override

from fabric.trainer.core.callback import Callback
from fabric.wrappers import FabricOptimizer

if TYPE_CHECKING:
    from fabric.trainer.core.logger import Logger
    from fabric.trainer.core.state import State


class LRMonitor(Callback):
    """Logs ``lr-{OptimizerClass}/group{i}`` for each param group at ``BATCH_END``.

    The optimizer's own class names it (``lr-AdamW/group0``), not Fabric's wrapper. When several
    optimizers share a class, the second and later get a numeric suffix (``lr-SGD-1/group0``).
    """

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        seen: Counter[str] = Counter()
        values: dict[str, float] = {}
        for optimizer in state.optimizers:
            name = type(_unwrapped(optimizer)).__name__
            prefix = f"lr-{name}" if not seen[name] else f"lr-{name}-{seen[name]}"
            seen[name] += 1
            for index, group in enumerate(optimizer.param_groups):
                values[f"{prefix}/group{index}"] = group["lr"]
        logger.log_metrics(values)


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, FabricOptimizer) else optimizer
