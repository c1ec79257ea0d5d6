"""Fault-tolerant FSDP2 shard groups: each replica group shards the model over its own processes (HSDP-style), and
torchft's quorum replicates across the groups."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from fabric.strategies.fault_tolerant.local_shards import (
    fingerprint,
    load_local_module_state,
    load_local_optimizer_state,
    local_module_state,
    local_optimizer_state,
)
from fabric.strategies.fault_tolerant.strategy import FaultTolerantStrategy, StateFunctions
from fabric.strategies.fsdp.strategy import FSDPStrategy


class FaultTolerantFSDPStrategy(FaultTolerantStrategy, FSDPStrategy):
    """Fault-tolerant replica groups (:class:`~fabric.strategies.fault_tolerant.strategy.FaultTolerantStrategy`)
    that each shard the model with FSDP2 over their own processes; ``**kwargs`` as
    :class:`~fabric.strategies.FSDPStrategy`'s (every group with the same processes and settings).

    A rank's gradient shard is averaged with the same rank's of the other groups (after FSDP's reduce-scatter inside
    the group), and a joining group receives each rank's shards of the weights and optimizer state from the same
    rank of a healthy group. torchft does not sync shards at the first step: every group must build the model alike
    (seed its initialisation the same way); the first step compares a checksum of the shards across the groups and
    stops every group that differs.
    """

    syncs_first_step = False

    @property
    @override
    def _gradients_final_when_accumulated(self) -> bool:
        """FSDP calls the hook on a shard once its gradient is reduce-scattered inside the group."""
        return True

    @override
    def _module_state(self, module: nn.Module) -> StateFunctions:
        return (lambda state: load_local_module_state(module, state)), (lambda: local_module_state(module))

    @override
    def _optimizer_state(self, optimizer: Optimizer) -> StateFunctions:
        return (lambda state: load_local_optimizer_state(optimizer, state)), (lambda: local_optimizer_state(optimizer))

    @override
    def _before_commit(self) -> None:
        """At the run's first step: refuse groups whose shards differ (torchft does not sync them)."""
        groups = self.replica_groups
        if groups.committed_steps != 0:
            return
        differs = torch.tensor([0 if groups.agree(fingerprint(self._modules)) else 1], device=self.root_device)
        if self.world_size > 1:
            dist.all_reduce(differs, op=dist.ReduceOp.MAX)  # every rank of the group stops, or none
        if differs.item():
            raise RuntimeError(
                f"Replica group {self.fault_tolerance.replica_group} started with other weights than a peer group: "
                "FSDP shard groups are not synced at the first step, so every group must build the model alike. "
                "Seed its initialisation the same way in every group (fabric.seed_everything(N) before building it)."
            )
