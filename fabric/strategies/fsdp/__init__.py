"""FSDP2: :class:`FSDPStrategy` (strategy.py), its sharded checkpoints (checkpoint.py) and Lightning's
arguments translated (options.py). Names load on first use, so a submodule imports without the strategy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.lazy import lazy_exports

if TYPE_CHECKING:
    from fabric.strategies.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy"]
__getattr__ = lazy_exports(__name__, {"FSDPStrategy": "fabric.strategies.fsdp.strategy"})
