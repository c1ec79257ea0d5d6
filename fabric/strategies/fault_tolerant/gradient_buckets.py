"""``GradientBuckets``: an optimizer's gradients averaged across the replica groups in buckets, each sent to torchft
as soon as the backward has produced it, so that the exchange overlaps the rest of the backward (as DDP's buckets
do inside a group)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from fabric.strategies.fault_tolerant.replica_groups import Averaging, ReplicaGroups
from fabric.utilities.dtensor import laid_out_like, local_part

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
    from torch.distributed.tensor import DTensor

#: DDP's bucket sizes: a small first bucket starts the exchange early in the backward, the others amortise its cost.
FIRST_BUCKET_BYTES = 1024 * 1024
BUCKET_BYTES = 25 * 1024 * 1024


class _Bucket:
    """Parameters whose gradients are exchanged together, and how many of them the backward has produced so far."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.parameters = parameters
        self.produced = 0
        #: The final gradients reported for this step (:meth:`GradientBuckets.produced`), by parameter id.
        self.final: dict[int, torch.Tensor] = {}
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

    Where a rank's gradient is final when autograd has accumulated it (``final_when_accumulated``: one process, or
    FSDP's shard after its reduce-scatter), autograd's hook reports it; else whoever completes it calls
    :meth:`produced` (DDP's comm hook, once the group's average is in its bucket), from any thread, with a tensor
    that holds it then. Those are exchanged as a copy, the memory they are in being another's.
    """

    def __init__(
        self, parameters: Sequence[torch.Tensor], groups: ReplicaGroups, *, final_when_accumulated: bool = True
    ) -> None:
        self._groups = groups
        self._buckets = _buckets_of([p for p in reversed(parameters) if p.requires_grad])
        self._bucket_of: dict[int, _Bucket] = {}
        for bucket in self._buckets:
            for parameter in bucket.parameters:
                self._bucket_of[id(parameter)] = bucket
                if final_when_accumulated:
                    parameter.register_post_accumulate_grad_hook(self._accumulated)  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()  # produced() may come from the threads of a process group's collectives
        self._sending = False
        #: Buckets before this index have been sent this step.
        self._sent = 0

    @contextlib.contextmanager
    def sending_during_backward(self) -> Iterator[None]:
        """Send each bucket as the backward run inside completes it (a backward that completes the gradients: not
        one of several accumulating them)."""
        for bucket in self._buckets[self._sent :]:
            bucket.produced = 0  # counted only from this backward
            bucket.final.clear()
        self._sending = True
        try:
            yield
        finally:
            with self._lock:
                self._sending = False

    def _accumulated(self, parameter: torch.Tensor) -> None:
        """Autograd's hook: ``parameter``'s gradient is final for this backward (FSDP calls it on the shard)."""
        if self._sending:
            self._count(self._bucket_of[id(parameter)])

    def produced(self, parameter: torch.Tensor, gradient: torch.Tensor) -> None:
        """``parameter``'s final gradient of this backward is ``gradient`` (until the backward returns); a parameter
        the optimizer does not step is not exchanged."""
        with self._lock:
            bucket = self._bucket_of.get(id(parameter))
            if self._sending and bucket is not None:
                bucket.final[id(parameter)] = gradient
                self._count(bucket)

    def _count(self, bucket: _Bucket) -> None:
        bucket.produced += 1
        while self._sent < len(self._buckets) and self._buckets[self._sent].complete:
            self._send(self._buckets[self._sent])

    def _send(self, bucket: _Bucket) -> None:
        final = bucket.final
        # Those with a gradient: DDP also reports the parameters a step did not use (as zeros), which keep None.
        bucket.sent = [p for p in bucket.parameters if p.grad is not None]
        gradients = [final.get(id(p)) if id(p) in final else local_part(p.grad) for p in bucket.sent]
        bucket.averaging = self._groups.start_averaging(gradients, copy=bool(final))  # type: ignore[arg-type]
        final.clear()
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


def average_in_group(
    process_group: dist.ProcessGroup, bucket: GradBucket, buckets: GradientBuckets | None
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook's work: ``bucket`` averaged over the group's processes (what DDP's default hook does), then its
    gradients reported to ``buckets``, which send them across the replica groups while the backward goes on."""
    buffer = bucket.buffer()
    buffer.div_(process_group.size())
    reduced = dist.all_reduce(buffer, group=process_group, async_op=True).get_future()
    parameters, gradients = bucket.parameters(), bucket.gradients()

    def report(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        if buckets is not None:
            for parameter, gradient in zip(parameters, gradients, strict=True):
                buckets.produced(parameter, gradient)
        return future.value()[0]

    return cast("torch.futures.Future[torch.Tensor]", reduced.then(report))


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
