"""Strategies: how the work is spread over devices and processes. ``STRATEGY_REGISTRY`` maps names.

Distributed strategies register themselves here by import path, so naming one costs no import until
it is chosen.
"""

from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.strategy import Strategy
from fabric.utilities.registry import Registry

STRATEGY_REGISTRY: Registry[Strategy] = Registry("strategy")
STRATEGY_REGISTRY.register("single_device", SingleDeviceStrategy, description="one device, one process")
_DDP = "fabric.strategies.ddp:DDPStrategy"
STRATEGY_REGISTRY.register("ddp", _DDP, description="DDP; launch() re-runs the script per rank", start_method="popen")
STRATEGY_REGISTRY.register("ddp_spawn", _DDP, description="DDP; launch(fn) spawns the ranks", start_method="spawn")
STRATEGY_REGISTRY.register("ddp_fork", _DDP, description="DDP; launch(fn) forks the ranks", start_method="fork")
STRATEGY_REGISTRY.register("ddp_notebook", _DDP, description="DDP from a notebook (fork)", start_method="fork")

__all__ = ["STRATEGY_REGISTRY", "SingleDeviceStrategy", "Strategy"]
