"""Collectives over ``torch.distributed`` with the semantics Fabric documents, for any world size.

- :func:`all_gather` stacks into ``(world_size, ...)``; tensors whose first dimension differs across
  ranks are padded for the transfer and returned trimmed, as a list (one tensor per rank).
- :func:`all_reduce` never mutates its input and never truncates an integer mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
import torch.distributed as dist
from typing_extensions import override

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")

ReduceOp = Literal["mean", "sum", "max", "min"]
REDUCE_OPS: tuple[ReduceOp, ...] = ("mean", "sum", "max", "min")


def parse_reduce_op(reduce_op: str) -> ReduceOp:
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported. Accepted values: {list(REDUCE_OPS)}.")
    return reduce_op


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, reduce_op: ReduceOp, group: ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks into a new tensor (the input is left untouched)."""
    result = tensor.clone()
    if reduce_op == "mean" and not torch.is_floating_point(result):
        result = result.to(torch.get_default_dtype())
    dist.all_reduce(result, op=_REDUCE_OPS[reduce_op], group=group)
    if reduce_op == "mean":
        result /= dist.get_world_size(group)
    return result


def all_gather(
    tensor: torch.Tensor, sync_grads: bool = False, group: ProcessGroup | None = None
) -> torch.Tensor | list[torch.Tensor]:
    """Gather ``tensor`` from every rank: a ``(world_size, ...)`` tensor, or a list if first dims differ.

    With ``sync_grads=True`` gradients flow back to each rank's input through the gather.
    """
    tensor = tensor.contiguous()
    shapes = _gather_shapes(tensor, group)
    if any(len(shape) != tensor.dim() or shape[1:] != tuple(tensor.shape[1:]) for shape in shapes):
        raise ValueError(f"all_gather needs tensors that differ at most in their first dimension; got shapes {shapes}.")
    max_rows = max(shape[0] for shape in shapes) if tensor.dim() else 0
    uneven = any(shape != shapes[0] for shape in shapes)
    if uneven:
        padding = torch.zeros(max_rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
        tensor = torch.cat([tensor, padding])
    if sync_grads:
        gathered = list(_AllGatherWithGrad.apply(tensor, group))  # type: ignore[no-untyped-call]
    else:
        gathered = [torch.empty_like(tensor) for _ in shapes]
        dist.all_gather(gathered, tensor, group=group)
    if uneven:
        return [piece[: shape[0]] for piece, shape in zip(gathered, shapes, strict=True)]
    return torch.stack(gathered)


class _AllGatherWithGrad(torch.autograd.Function):
    """``all_gather`` whose backward sends each rank the sum over ranks of the gradient of its piece."""

    @staticmethod
    @override
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return tuple(gathered)

    @staticmethod
    @override
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        stacked = torch.stack(grads)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def _gather_shapes(tensor: torch.Tensor, group: ProcessGroup | None) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shapes, tuple(tensor.shape), group=group)
    return [shape for shape in shapes if shape is not None]


def broadcast_object(obj: T, src: int, group: ProcessGroup | None = None) -> T:
    """Send a tensor or any picklable object from rank ``src`` to every rank."""
    container = [obj]
    dist.broadcast_object_list(container, src=src, group=group)
    return container[0]


def default_store() -> Any:
    """The default process group's rendezvous store (every rank is a client of the same server)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
