"""DeepSpeed ZeRO: :class:`DeepSpeedStrategy` and :func:`convert_zero_checkpoint_to_fp32` (strategy.py), the
config Fabric completes (config.py) and its precision (precision.py). Names load on first use, and the
``deepspeed`` package itself only when the strategy is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.strategies.deepspeed.strategy import DeepSpeedStrategy, convert_zero_checkpoint_to_fp32

__all__ = ["DeepSpeedStrategy", "convert_zero_checkpoint_to_fp32"]
__getattr__ = lazy_exports(
    __name__,
    {
        "DeepSpeedStrategy": "fabric.strategies.deepspeed.strategy",
        "convert_zero_checkpoint_to_fp32": "fabric.strategies.deepspeed.strategy",
    },
)
