"""A rank's own part of a sharded module and optimizer, as plain tensors: what a replica group of FSDP2 shards sends
a joining group, rank to rank (the same rank of every group holds the same shards, since every group is laid out
alike), and what it loads back into the ``DTensor``s."""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fabric.utilities.dtensor import laid_out_like, local_part


def local_module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every ``DTensor`` replaced by this rank's shard."""
    return {name: local_part(value) for name, value in module.state_dict().items()}


def load_local_module_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy :func:`local_module_state` of the same rank of a peer group into ``module``'s shards, in place."""
    own = module.state_dict()
    if set(own) != set(state):
        raise ValueError(f"A peer group sent the state of another module: {sorted(set(own) ^ set(state))} differ.")
    with torch.no_grad():
        for name, value in own.items():
            local_part(value).copy_(state[name])


def local_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with this rank's shard of every ``DTensor`` (momentum, Adam's moments)."""
    saved = optimizer.state_dict()
    state = {index: {key: local_part(value) for key, value in entry.items()} for index, entry in saved["state"].items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def load_local_optimizer_state(optimizer: Optimizer, saved: dict[str, Any]) -> None:
    """Load :func:`local_optimizer_state` of a peer: each per-parameter tensor shaped like the parameter's shard
    becomes a ``DTensor`` laid out as the parameter (a joining group's optimizer has no state to copy into yet)."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    state = {
        index: {key: _shaped_like(parameters[index], value) for key, value in entry.items()}
        for index, entry in saved["state"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def fingerprint(modules: list[nn.Module]) -> int:
    """A checksum (below 2**32) of this rank's shards of every parameter and buffer of ``modules``."""
    checksum = 0
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            local = local_part(tensor.detach()).contiguous().cpu()
            checksum = zlib.crc32(local.view(torch.uint8).numpy().tobytes(), checksum) if local.numel() else checksum
    return checksum


def _shaped_like(parameter: torch.Tensor, value: Any) -> Any:
    if not isinstance(parameter, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape != parameter.to_local().shape:
        return value
    return laid_out_like(value, parameter)
