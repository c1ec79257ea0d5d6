"""The gradients' buckets of a fault-tolerant strategy, against a stand-in for torchft's exchange that records what it
was sent and when: which buckets, in which order, during or after the backward (or before a given gradient). The
exchange itself, across real replica groups, runs in test_fault_tolerant.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric.strategies.fault_tolerant.gradient_buckets import FIRST_BUCKET_BYTES, GradientBuckets, average_in_group


class _Exchange:
    """``start_averaging`` as :class:`ReplicaGroups` offers it, with one peer group: the "average" is half the sum of
    what was sent and what the peer sends (zeros unless ``peer`` says otherwise; nothing of this group's where it is
    ``joining``, as torchft's exchange takes a joining group's), and each send is recorded with the tensors' sizes and
    whether the backward was still running."""

    def __init__(self, peer: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like, joining: bool = False) -> None:
        self.sent: list[tuple[list[int], bool]] = []
        self.copied: list[bool] = []
        self.in_backward = False
        self._peer, self._joining = peer, joining

    def in_backward_before(self) -> bool:
        """Whether the backward is still running (a test narrows it to: before a given gradient)."""
        return self.in_backward

    def start_averaging(self, tensors: list[torch.Tensor], copy: bool = False) -> Any:
        self.sent.append(([t.numel() for t in tensors], self.in_backward_before()))
        self.copied.append(copy)
        averages = [(t.detach() * (not self._joining) + self._peer(t)) / 2 for t in tensors]
        return type("Averaging", (), {"wait": lambda _: averages})()


def _model() -> nn.Sequential:
    """Three layers, the middle one over ``FIRST_BUCKET_BYTES``: two buckets, the backward completes the last layer's
    first."""
    width = int((FIRST_BUCKET_BYTES / 4) ** 0.5) + 8
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def _backward(model: nn.Module, exchange: _Exchange, seed: int = 0) -> None:
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    exchange.in_backward = True
    model(inputs).sum().backward()
    exchange.in_backward = False


def test_the_first_bucket_goes_out_during_the_backward_and_every_gradient_comes_back_averaged() -> None:
    model, exchange = _model(), _Exchange()
    exchange.in_backward_before = lambda: model[0].weight.grad is None  # type: ignore[method-assign]
    buckets = GradientBuckets(list(model.parameters()), exchange)  # type: ignore[arg-type]
    reference = _model()
    _backward(reference, _Exchange())
    with buckets.sending_during_backward():
        _backward(model, exchange)
    buckets.average()
    last, middle, first = model[4], model[2], model[0]
    # reverse order: the last layer's bias and weight with the middle layer's, before the backward reached the first
    # layer; then the first layer's
    assert exchange.sent == [
        ([1, last.weight.numel(), middle.bias.numel(), middle.weight.numel()], True),
        ([first.bias.numel(), first.weight.numel(), 6], False),  # with which of the 6 parameters had a gradient
    ]
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert parameter.grad is not None and expected.grad is not None
        torch.testing.assert_close(parameter.grad, expected.grad / 2)


def test_accumulating_backwards_send_nothing_and_the_last_sends_the_sum() -> None:
    model, exchange = _model(), _Exchange()
    buckets = GradientBuckets(list(model.parameters()), exchange)  # type: ignore[arg-type]
    reference = _model()
    for seed in (1, 2):
        _backward(reference, _Exchange(), seed)
    _backward(model, exchange, seed=1)  # outside sending_during_backward: accumulating
    assert exchange.sent == []
    with buckets.sending_during_backward():
        _backward(model, exchange, seed=2)
    assert [during for _, during in exchange.sent] == [True, True]
    buckets.average()
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, expected.grad / 2)  # type: ignore[operator]


def test_a_bucket_the_backward_completes_first_waits_for_the_one_before_it() -> None:
    """Buckets go out in one order on every group (the groups' exchanges pair up in order): where the backward
    completes the second before the first (the last layer used first), both go out when the first completes."""
    model, exchange = _model(), _Exchange()
    # parameters in the reverse of their use: bucket 0 holds the first layer, which the backward reaches last
    buckets = GradientBuckets(list(reversed(list(model.parameters()))), exchange)  # type: ignore[arg-type]
    with buckets.sending_during_backward():
        _backward(model, exchange)
    first, middle = model[0], model[2]
    assert [sizes for sizes, _ in exchange.sent] == [
        [first.weight.numel(), first.bias.numel(), middle.weight.numel()],
        [middle.bias.numel(), model[4].weight.numel(), 1, 6],
    ]
    assert all(during for _, during in exchange.sent)  # both at the backward's last gradient


def _with_unreached(exchange: _Exchange) -> tuple[nn.Sequential, nn.Parameter, GradientBuckets]:
    """The model's last two layers and a parameter the backward does not reach, in buckets of their own."""
    model = _model()
    model[0].requires_grad_(False)
    unreached = nn.Parameter(torch.ones(2))
    parameters = [*model[2].parameters(), *model[4].parameters()]
    buckets = GradientBuckets([unreached, *parameters], exchange)  # type: ignore[arg-type]
    with buckets.sending_during_backward():
        _backward(model, exchange)
    buckets.average()
    return model, unreached, buckets


def test_a_parameter_the_backward_does_not_reach_sends_zeros_after_it_and_keeps_no_gradient_if_no_group_had_one() -> (
    None
):
    """Every group sends every parameter (the exchanges pair up), zeros for one without a gradient; the last send
    says which had one."""
    exchange = _Exchange()
    model, unreached, _ = _with_unreached(exchange)
    assert unreached.grad is None
    assert exchange.sent == [
        ([1, model[4].weight.numel(), model[2].bias.numel(), model[2].weight.numel()], True),
        ([2, 5], False),  # after the backward: its 2 zeros, and which of the 5 parameters had a gradient
    ]


def test_a_parameter_without_a_gradient_here_takes_the_average_of_a_group_that_had_one() -> None:
    """A branch only the peer group's batch took: this group's zeros and the peer's gradient averaged, as plain DDP
    over both groups' processes computes it."""
    model, unreached, _ = _with_unreached(_Exchange(peer=torch.ones_like))
    torch.testing.assert_close(unreached.grad, torch.full((2,), 0.5))
    reference = _model()
    _backward(reference, _Exchange())
    torch.testing.assert_close(model[2].weight.grad, (reference[2].weight.grad + 1) / 2)  # type: ignore[operator]


def test_a_joining_group_keeps_no_gradient_where_the_others_had_none() -> None:
    """A group that has just joined sends nothing of its own (torchft takes zeros): where the others had no gradient
    it keeps None, not the one it computed, or its optimizer would step what the others' leave alone."""
    model, _, _ = _with_unreached(_Exchange(joining=True))
    assert all(p.grad is None for p in [*model[2].parameters(), *model[4].parameters()])


def test_a_parameter_unfrozen_after_the_buckets_were_laid_out_is_refused_naming_it() -> None:
    """Frozen at set-up, it is in no bucket: its gradient would stay each group's own (they would drift apart)."""
    model, exchange = _model(), _Exchange()
    model[0].requires_grad_(False)
    buckets = GradientBuckets(list(model.parameters()), exchange)  # type: ignore[arg-type]
    _backward(model, exchange)
    buckets.average()  # frozen and without a gradient: fine
    model[0].requires_grad_(True)
    _backward(model, exchange)
    with pytest.raises(RuntimeError, match=r"Parameter 0 of the optimizer \(shape \(.*, 4\)\) had requires_grad=False"):
        buckets.average()


def test_an_optimizer_of_frozen_parameters_only_exchanges_nothing() -> None:
    model, exchange = _model(), _Exchange()
    model.requires_grad_(False)
    GradientBuckets(list(model.parameters()), exchange).average()  # type: ignore[arg-type]
    assert exchange.sent == []


def test_gradients_that_tile_one_buffer_are_exchanged_in_place_and_others_in_a_copy() -> None:
    """FSDP's gradient shards are views of one reduce-scatter output: exchanged as that memory, in place; tensors
    with a gap, an overlap or memory of their own are concatenated."""
    from fabric.strategies.fault_tolerant.replica_groups import _span

    buffer = torch.arange(10.0)
    weight, bias = buffer[:6].view(2, 3), buffer[6:10]
    span = _span([bias, weight])  # in any order
    assert span is not None and span.data_ptr() == buffer.data_ptr() and span.numel() == 10
    assert _span([buffer[:4], buffer[5:]]) is None  # a gap
    assert _span([buffer[:6], buffer[4:]]) is None  # an overlap
    assert _span([buffer[:4], torch.ones(3)]) is None  # two buffers
    assert _span([buffer.view(2, 5).t()]) is None  # not contiguous


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_reporting(
    module: nn.Module, parameters: list[nn.Parameter], exchange: _Exchange, **ddp_options: Any
) -> tuple[DistributedDataParallel, GradientBuckets]:
    """``module`` under DDP whose comm hook reports to buckets of ``parameters``, as a DDP replica group's."""
    ddp = DistributedDataParallel(module, **ddp_options)
    buckets = GradientBuckets(parameters, exchange, final_when_accumulated=False)  # type: ignore[arg-type]
    ddp.register_comm_hook(ddp.process_group, lambda group, bucket: average_in_group(group, bucket, buckets))
    return ddp, buckets


def test_ddp_buckets_report_their_group_average_during_the_backward_and_are_exchanged_as_a_copy(
    one_rank_group: None,
) -> None:
    """DDP groups of several processes: DDP's comm hook averages a bucket inside the group, then reports it, and the
    buckets go out before the backward returns, also at the first step, where DDP holds every gradient in one bucket
    (it rebuilds them after it). The exchange copies them: the memory is DDP's."""
    model, exchange = _model(), _Exchange()
    ddp, buckets = _ddp_reporting(model, list(model.parameters()), exchange)
    reference = _model()
    for step in range(3):
        reference.zero_grad(set_to_none=True)
        _backward(reference, _Exchange(), seed=step)
        model.zero_grad(set_to_none=True)
        exchange.sent.clear()
        with buckets.sending_during_backward():
            _backward(ddp, exchange, seed=step)
        buckets.average()
        assert [during for _, during in exchange.sent] == [True, True]
        assert exchange.copied == [True] * 2 * (step + 1)
        for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(parameter.grad, expected.grad / 2)  # type: ignore[operator]


def test_ddp_buckets_outside_a_sending_backward_are_left_to_the_average_after_it(one_rank_group: None) -> None:
    """A backward whose gradients are accumulated further (DDP synced by hand) reports nothing: the average after it
    sends the gradients as they are then."""
    model, exchange = _model(), _Exchange()
    ddp, buckets = _ddp_reporting(model, list(model.parameters()), exchange)
    _backward(ddp, exchange)
    assert exchange.sent == []
    buckets.average()
    assert [during for _, during in exchange.sent] == [False, False] and exchange.copied == [False, False]


def test_ddp_reports_of_parameters_the_optimizer_does_not_step_are_not_exchanged(one_rank_group: None) -> None:
    """A model trained in part (the optimizer holds the last two layers): DDP's buckets also hold the first layer,
    whose gradient stays the group's own."""
    model, exchange = _model(), _Exchange()
    stepped = [*model[2].parameters(), *model[4].parameters()]
    ddp, buckets = _ddp_reporting(model, stepped, exchange)
    reference = _model()
    _backward(reference, _Exchange())
    with buckets.sending_during_backward():
        _backward(ddp, exchange)
    buckets.average()
    sizes = sorted(size for sizes, _ in exchange.sent for size in sizes)
    assert sizes == sorted([len(stepped), *(p.numel() for p in stepped)])  # with which of them had a gradient
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    torch.testing.assert_close(model[2].weight.grad, reference[2].weight.grad / 2)  # type: ignore[operator]


class _WithUnused(nn.Module):
    """``used`` in the forward, ``unused`` never."""

    def __init__(self, used: nn.Module, unused: nn.Module) -> None:
        super().__init__()
        self.used, self.unused = used, unused

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.used(inputs)  # type: ignore[no-any-return]


def test_a_parameter_ddp_reports_unused_keeps_no_gradient_as_under_plain_ddp(one_rank_group: None) -> None:
    """``find_unused_parameters=True``: DDP reports a layer the step did not use (its bucket holds zeros), sent as
    such; its gradient stays None where no group had one, so the optimizer leaves it alone, as under plain DDP."""
    model, exchange = _model(), _Exchange()
    unused = nn.Linear(3, 3)
    both = _WithUnused(model, unused)
    ddp, buckets = _ddp_reporting(both, list(both.parameters()), exchange, find_unused_parameters=True)
    with buckets.sending_during_backward():
        _backward(ddp, exchange)
    buckets.average()
    assert unused.weight.grad is None and unused.bias.grad is None
    assert all(p.grad is not None for layer in (model[0], model[2], model[4]) for p in layer.parameters())
    assert sum(size for sizes, _ in exchange.sent for size in sizes) == sum(p.numel() + 1 for p in both.parameters())
