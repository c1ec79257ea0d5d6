"""A rank's shards of an FSDP2 module and its optimizer, sent as plain tensors and loaded back (what a joining shard
group receives), in a process group of one: the multi-rank case runs in test_fault_tolerant.py."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from fabric.strategies.fault_tolerant.local_shards import (
    fingerprint,
    load_local_module_state,
    load_local_optimizer_state,
    local_module_state,
    local_optimizer_state,
)


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()


def _sent(state: Any) -> Any:
    """``state`` as the joiner receives it: serialised, as torchft's checkpoint transport does (no shared storage)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().full_tensor() for p in model.parameters()]


@pytest.mark.usefixtures("group_of_one")
def test_a_joiner_given_the_local_shards_trains_on_exactly_as_the_peer() -> None:
    peer, peer_optimizer = _sharded(seed=0)
    for seed in range(3):
        _step(peer, peer_optimizer, seed)
    joiner, joiner_optimizer = _sharded(seed=1)  # built apart, never stepped: no optimizer state yet
    assert fingerprint([joiner]) != fingerprint([peer])

    module_state, optimizer_state = _sent(local_module_state(peer)), _sent(local_optimizer_state(peer_optimizer))
    assert not any(isinstance(value, DTensor) for value in module_state.values())  # plain tensors travel
    load_local_module_state(joiner, module_state)
    load_local_optimizer_state(joiner_optimizer, optimizer_state)

    assert fingerprint([joiner]) == fingerprint([peer])
    moments = [state["exp_avg"] for state in joiner_optimizer.state.values()]
    assert moments and all(isinstance(moment, DTensor) for moment in moments)  # laid out as the parameters
    _step(peer, peer_optimizer, seed=3)
    _step(joiner, joiner_optimizer, seed=3)
    for mine, theirs in zip(_weights(joiner), _weights(peer), strict=True):
        assert torch.equal(mine, theirs)  # the same moments and step count: the same update


@pytest.mark.usefixtures("group_of_one")
def test_the_state_of_another_module_is_refused_naming_the_entries() -> None:
    model, _ = _sharded(seed=0)
    state = local_module_state(model)
    state["extra.weight"] = state.pop("2.weight")
    with pytest.raises(ValueError, match=r"another module: \['2.weight', 'extra.weight'\] differ"):
        load_local_module_state(model, state)
