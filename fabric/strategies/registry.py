"""``STRATEGY_REGISTRY``: strategy names to classes, named lazily so the registry costs no torch import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.registry import Registry

if TYPE_CHECKING:
    from fabric.strategies.strategy import Strategy

_DDP = "fabric.strategies.ddp:DDPStrategy"

STRATEGY_REGISTRY: Registry[Strategy] = Registry("strategy")
STRATEGY_REGISTRY.register(
    "single_device", "fabric.strategies.single_device:SingleDeviceStrategy", description="one device, one process"
)
STRATEGY_REGISTRY.register("ddp", _DDP, description="DDP; launch() re-runs the script per rank", start_method="popen")
STRATEGY_REGISTRY.register("ddp_spawn", _DDP, description="DDP; launch(fn) spawns the ranks", start_method="spawn")
STRATEGY_REGISTRY.register("ddp_fork", _DDP, description="DDP; launch(fn) forks the ranks", start_method="fork")
STRATEGY_REGISTRY.register("ddp_notebook", _DDP, description="DDP from a notebook (fork)", start_method="fork")


def strategy_choices() -> list[str]:
    """Every strategy string a user may type."""
    return ["auto", *STRATEGY_REGISTRY.choices()]
