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
        #: The exchange in flight, and which of the parameters had a gradient on this rank when it was sent.
        self.averaging: Averaging | None = None
        self.had_gradient: list[bool] = []

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

    Every bucket sends every one of its parameters, zeros where this rank has no gradient (a branch this group's
    batch did not take), so that the groups' exchanges pair up; the last one sent also carries which parameters had
    a gradient, and one keeps None after the average only where no group's had one, as plain DDP over all the
    groups' processes leaves it.

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
        #: The parameters frozen at set-up, by their place in the optimizer: none may get a gradient later.
        self._frozen = [(index, p) for index, p in enumerate(parameters) if not p.requires_grad]
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
        bucket.had_gradient = [p.grad is not None for p in bucket.parameters]
        gradients = [_to_send(p, final) for p in bucket.parameters]
        self._sent += 1
        if self._sent == len(self._buckets):  # every bucket's parameters are known by now
            had_gradient = [had for sent in self._buckets for had in sent.had_gradient]
            gradients.append(torch.tensor(had_gradient, dtype=gradients[0].dtype, device=gradients[0].device))
        bucket.averaging = self._groups.start_averaging(gradients, copy=bool(final))
        final.clear()

    def average(self) -> None:
        """Every gradient averaged across the groups, in place: the buckets not sent yet are sent now (in order),
        then every exchange is waited for."""
        self._refuse_unfrozen()
        if not self._buckets:
            return
        while self._sent < len(self._buckets):
            self._send(self._buckets[self._sent])
        averages = []
        for bucket in self._buckets:
            assert bucket.averaging is not None
            averages.append(bucket.averaging.wait())
            bucket.averaging, bucket.produced = None, 0
        had_gradient = averages[-1].pop().tolist()  # the share of the groups where each parameter had one
        parameters = (parameter for bucket in self._buckets for parameter in bucket.parameters)
        gradients = (gradient for bucket_averages in averages for gradient in bucket_averages)
        for parameter, average, share in zip(parameters, gradients, had_gradient, strict=True):
            if share > 0:
                _take_gradient(parameter, average)
            else:  # even this rank's own: a group that just joined sends zeros and takes the others' average
                parameter.grad = None
        self._sent = 0

    def _refuse_unfrozen(self) -> None:
        """A ``RuntimeError`` for a parameter frozen when the buckets were laid out that has a gradient now: it is in
        no bucket, so the groups would each step their own, and drift apart without a word."""
        for index, parameter in self._frozen:
            if parameter.grad is not None:
                raise RuntimeError(
                    f"Parameter {index} of the optimizer (shape {tuple(parameter.shape)}) had requires_grad=False "
                    "at fabric.setup and has a gradient now: the replica groups exchange only the gradients laid "
                    "out at set-up. Set requires_grad on every parameter to train before fabric.setup (freezing "
                    "later is fine)."
                )


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


def _to_send(parameter: torch.Tensor, final: dict[int, torch.Tensor]) -> torch.Tensor:
    """This rank's part of ``parameter``'s gradient: as reported final, else as accumulated, else zeros (where it has
    none, so that the exchange is the same size on every group)."""
    if id(parameter) in final:
        return final[id(parameter)]
    if parameter.grad is None:
        return torch.zeros_like(local_part(parameter))
    return cast("torch.Tensor", local_part(parameter.grad))


def _take_gradient(parameter: torch.Tensor, average: torch.Tensor) -> None:
    """``parameter``'s gradient becomes ``average`` (the gradient itself where it was averaged in place, else a view of
    the exchanged buffer, not copied back; a ``DTensor`` keeps its layout around it, or takes the parameter's where
    this rank had no gradient)."""
    gradient = parameter.grad
    like = parameter if gradient is None else gradient
    local = local_part(like)
    if local is like:
        parameter.grad = average
    elif gradient is None or local.data_ptr() != average.data_ptr():
        parameter.grad = laid_out_like(average, cast("DTensor", like))
