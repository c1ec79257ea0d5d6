"""Activation checkpointing of whole modules (``checkpoint_activations``), in one process: recomputed in the
backward, for each part of a backward split in two (the zero-bubble schedules), and a deep copy recomputing with its
own weights. Under FSDP on real ranks: tests/strategies/fsdp (the Lightning-arguments job counts a block's calls) and
the pipeline job ``ZBVZeroBubble-checkpointed``."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from fabric.strategies.fsdp.activation_checkpointing import checkpoint_activations


class CountingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(inputs))


def _pair() -> tuple[CountingBlock, CountingBlock]:
    torch.manual_seed(0)
    plain = CountingBlock()
    checkpointed = copy.deepcopy(plain)
    checkpoint_activations(checkpointed)
    return plain, checkpointed


def test_a_checkpointed_module_runs_its_forward_again_in_the_backward_with_the_same_gradients() -> None:
    plain, checkpointed = _pair()
    inputs = torch.randn(3, 4)
    for block in (plain, checkpointed):
        block(inputs).square().sum().backward()
    assert (plain.calls, checkpointed.calls) == (1, 2)
    assert list(checkpointed.state_dict()) == ["linear.weight", "linear.bias"]  # names unchanged
    for mine, expected in zip(checkpointed.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, expected.grad)


def test_a_backward_split_into_the_inputs_and_the_weights_gradients_recomputes_for_each() -> None:
    """What the zero-bubble schedules run: torch's composable checkpoint failed the second recomputation."""
    plain, checkpointed = _pair()
    results = []
    for block in (plain, checkpointed):
        inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        outputs = block(inputs)
        gradients, groups = stage_backward_input([outputs], [torch.ones_like(outputs)], [inputs], block.parameters())
        stage_backward_weight(block.parameters(), groups)
        results.append((gradients[0], [p.grad for p in block.parameters()]))
    torch.testing.assert_close(results[1], results[0])
    assert checkpointed.calls >= 2


def test_a_deep_copy_recomputes_with_its_own_weights() -> None:
    _, checkpointed = _pair()
    twin = copy.deepcopy(checkpointed)
    with torch.no_grad():
        twin.linear.weight.mul_(2)
    inputs = torch.randn(3, 4)
    twin(inputs).sum().backward()
    assert twin.calls == 2 and checkpointed.calls == 0
    assert checkpointed.linear.weight.grad is None and twin.linear.weight.grad is not None
