"""``STRATEGY_REGISTRY``: strategy names to classes, named lazily so the registry costs no torch import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.utilities.registry import Registry

if TYPE_CHECKING:
    from fabric.strategies.strategy import Strategy

_DDP = "fabric.strategies.ddp:DDPStrategy"
_FSDP = "fabric.strategies.fsdp.strategy:FSDPStrategy"
_DEEPSPEED = "fabric.strategies.deepspeed.strategy:DeepSpeedStrategy"

STRATEGY_REGISTRY: Registry[Strategy] = Registry("strategy")
STRATEGY_REGISTRY.register(
    "single_device", "fabric.strategies.single_device:SingleDeviceStrategy", description="one device, one process"
)
STRATEGY_REGISTRY.register("ddp", _DDP, description="DDP; launch() re-runs the script per rank", start_method="popen")
STRATEGY_REGISTRY.register("ddp_spawn", _DDP, description="DDP; launch(fn) spawns the ranks", start_method="spawn")
STRATEGY_REGISTRY.register("ddp_fork", _DDP, description="DDP; launch(fn) forks the ranks", start_method="fork")
STRATEGY_REGISTRY.register("ddp_notebook", _DDP, description="DDP from a notebook (fork)", start_method="fork")
STRATEGY_REGISTRY.register("fsdp", _FSDP, description="FSDP2: parameters, gradients, optimizer state sharded")
STRATEGY_REGISTRY.register(
    "fsdp_cpu_offload", _FSDP, description="FSDP2 with shards offloaded to CPU memory", cpu_offload=True
)
STRATEGY_REGISTRY.register(
    "model_parallel",
    "fabric.strategies.model_parallel:ModelParallelStrategy",
    description="tensor parallelism (your parallelize_fn) x FSDP2 on a 2-D mesh; pass ModelParallelStrategy(fn)",
)
STRATEGY_REGISTRY.register(
    "fault_tolerant_ddp",
    "fabric.strategies.fault_tolerant.strategy:FaultTolerantDDPStrategy",
    description="DDP in each replica group, torchft's quorum across groups: a dead group does not stop the run",
)
STRATEGY_REGISTRY.register(
    "fault_tolerant_fsdp",
    "fabric.strategies.fault_tolerant.fsdp:FaultTolerantFSDPStrategy",
    description="FSDP2 shards in each replica group, torchft's quorum across groups (HSDP that survives a dead group)",
)
STRATEGY_REGISTRY.register("deepspeed", _DEEPSPEED, description="DeepSpeed; ZeRO stage from the config, else 2")
STRATEGY_REGISTRY.register("deepspeed_stage_1", _DEEPSPEED, description="DeepSpeed ZeRO-1: optimizer state", stage=1)
STRATEGY_REGISTRY.register("deepspeed_stage_2", _DEEPSPEED, description="DeepSpeed ZeRO-2: + gradients", stage=2)
STRATEGY_REGISTRY.register(
    "deepspeed_stage_2_offload",
    _DEEPSPEED,
    description="DeepSpeed ZeRO-2, optimizer state offloaded to CPU",
    stage=2,
    offload_optimizer=True,
)
STRATEGY_REGISTRY.register("deepspeed_stage_3", _DEEPSPEED, description="DeepSpeed ZeRO-3: + parameters", stage=3)
STRATEGY_REGISTRY.register(
    "deepspeed_stage_3_offload",
    _DEEPSPEED,
    description="DeepSpeed ZeRO-3, parameters and optimizer state offloaded to CPU",
    stage=3,
    offload_optimizer=True,
    offload_parameters=True,
)


def strategy_choices() -> list[str]:
    """Every strategy string a user may type."""
    return ["auto", *STRATEGY_REGISTRY.choices()]
