"""Strategies: how the work is spread over devices and processes. ``STRATEGY_REGISTRY`` maps names.

Distributed strategies register themselves here by import path, so naming one costs no import until
it is chosen.
"""

from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.strategy import Strategy
from fabric.utilities.registry import Registry

STRATEGY_REGISTRY: Registry[Strategy] = Registry("strategy")
STRATEGY_REGISTRY.register("single_device", SingleDeviceStrategy, description="one device, one process")

__all__ = ["STRATEGY_REGISTRY", "SingleDeviceStrategy", "Strategy"]
