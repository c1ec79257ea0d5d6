"""``GradientBuckets``: an optimizer's gradients averaged across the replica groups in buckets, each sent to torchft
as soon as the backward has produced it, so that the exchange overlaps the rest of the backward (as DDP's buckets
do inside a group)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch

from fabric.strategies.fault_tolerant.replica_groups import Averaging, ReplicaGroups
from fabric.utilities.dtensor import laid_out_like, local_part

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: DDP's bucket sizes: a small first bucket starts the exchange early in the backward, the others amortise its cost.
FIRST_BUCKET_BYTES = 1024 * 1024
BUCKET_BYTES = 25 * 1024 * 1024


class _Bucket:
    """Parameters whose gradients are exchanged together, and how many of them the backward has produced so far."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.parameters = parameters
        self.produced = 0
        #: The exchange in flight, and the parameters whose gradients it holds (those that had one when sent).
        self.averaging: Averaging | None = None
        self.sent: list[torch.Tensor] = []

    @property
    def complete(self) -> bool:
        return self.produced == len(self.parameters)


class GradientBuckets:
    """The gradients of ``parameters`` (an optimizer's), in DDP-sized buckets of their reverse order (the order a
    backward produces them in).

    Inside :meth:`sending_during_backward` a bucket whose every gradient is final is sent to torchft at once; buckets
    are sent in the same order on every group (one completed early waits for those before it), since the groups'
    exchanges pair up in the order they start. :meth:`average` sends what is left (gradients accumulated outside it,
    or parameters the backward did not reach) and puts the averages in place.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], groups: ReplicaGroups) -> None:
        self._groups = groups
        self._buckets = _buckets_of([p for p in reversed(parameters) if p.requires_grad])
        self._bucket_of: dict[int, _Bucket] = {}
        for bucket in self._buckets:
            for parameter in bucket.parameters:
                self._bucket_of[id(parameter)] = bucket
                parameter.register_post_accumulate_grad_hook(self._produced)  # type: ignore[no-untyped-call]
        self._sending = False
        #: Buckets before this index have been sent this step.
        self._sent = 0

    @contextlib.contextmanager
    def sending_during_backward(self) -> Iterator[None]:
        """Send each bucket as the backward run inside completes it (a backward that completes the gradients: not
        one of several accumulating them)."""
        for bucket in self._buckets[self._sent :]:
            bucket.produced = 0  # counted only from this backward
        self._sending = True
        try:
            yield
        finally:
            self._sending = False

    def _produced(self, parameter: torch.Tensor) -> None:
        """Autograd's hook: ``parameter``'s gradient is final for this backward (FSDP calls it on the shard)."""
        if not self._sending:
            return
        self._bucket_of[id(parameter)].produced += 1
        while self._sent < len(self._buckets) and self._buckets[self._sent].complete:
            self._send(self._buckets[self._sent])

    def _send(self, bucket: _Bucket) -> None:
        bucket.sent = [p for p in bucket.parameters if p.grad is not None]
        bucket.averaging = self._groups.start_averaging([local_part(p.grad) for p in bucket.sent])
        self._sent += 1

    def average(self) -> None:
        """Every gradient averaged across the groups, in place: the buckets not sent yet are sent now (in order),
        then every exchange is waited for."""
        while self._sent < len(self._buckets):
            self._send(self._buckets[self._sent])
        for bucket in self._buckets:
            assert bucket.averaging is not None
            for parameter, average in zip(bucket.sent, bucket.averaging.wait(), strict=True):
                _take_gradient(parameter, average)
            bucket.averaging, bucket.sent, bucket.produced = None, [], 0
        self._sent = 0


def _buckets_of(parameters: list[torch.Tensor]) -> list[_Bucket]:
    """Consecutive runs of ``parameters`` of at least a bucket's bytes each (the first ``FIRST_BUCKET_BYTES``)."""
    buckets: list[_Bucket] = []
    current: list[torch.Tensor] = []
    size = 0
    for parameter in parameters:
        current.append(parameter)
        size += local_part(parameter).numel() * parameter.element_size()
        if size >= (BUCKET_BYTES if buckets else FIRST_BUCKET_BYTES):
            buckets.append(_Bucket(current))
            current, size = [], 0
    if current:
        buckets.append(_Bucket(current))
    return buckets


def _take_gradient(parameter: torch.Tensor, average: torch.Tensor) -> None:
    """``parameter``'s gradient becomes ``average`` (the gradient itself where it was averaged in place, else a view of
    the exchanged buffer, not copied back; a ``DTensor`` keeps its layout around it)."""
    gradient = parameter.grad
    local = local_part(gradient)
    if local is gradient:
        parameter.grad = average
    elif local.data_ptr() != average.data_ptr():
        parameter.grad = laid_out_like(average, cast("DTensor", gradient))
